"""heterps_ray: heterogeneous parameter-server training of CTR models on Ray.

Data flows one way through the parts: config -> profiling -> costmodel (problem) -> scheduling
(plan) -> runtime -> metrics. See README.md and DESIGN notes in docs/.
"""

__version__ = "0.1.0"
