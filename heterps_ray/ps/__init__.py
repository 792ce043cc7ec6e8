"""heterps_ray.ps"""
