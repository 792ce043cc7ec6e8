"""heterps_ray.serving: the trained model out of the system (``heterps export``) and batch scoring on
Ray (``heterps predict``)."""
