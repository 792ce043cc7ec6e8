"""Where scripts/gpu_check.py finds :class:`LayerProfiler`: the class lives in heterps_ray.profiling_host,
below both the profiler and the runtime."""

from heterps_ray.profiling_host import LayerProfiler, ProfilingHost

__all__ = ["LayerProfiler", "ProfilingHost"]
