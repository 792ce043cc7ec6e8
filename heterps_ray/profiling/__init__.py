"""heterps_ray.profiling — live per-layer profiling on each resource type, and the fits to a problem file.

    from heterps_ray.profiling.profiler import ProfileSettings, profile   # needs a running Ray
    from heterps_ray.profiling.fit import fit_problem, write_problem       # plain numpy / pandas

`heterps profile JOB.yaml --output problem.yaml` does both: its command lives in
heterps_ray.closedloop.profile_command, since it also runs the runtime's probes (closedloop/probes.py).
"""
