"""heterps_ray.profiling"""
