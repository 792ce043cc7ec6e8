"""heterps_ray.deploy: cluster configs rendered for the clusters users run (KubeRay, `ray up`)."""
