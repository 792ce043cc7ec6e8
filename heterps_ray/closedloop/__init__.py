"""heterps_ray.closedloop: the system end to end, above the runtime and the profiler.

`heterps run` (run.py) profiles the cluster, fits the problem, plans, trains and reports; while it
trains it keeps the throughput floor (refit and re-plan on a miss) and follows the cluster's resource
types (re-plan on a change, profiling a type that joined) — replan.py. The runtime probes of the
profile (probes.py) train with the runtime, so they live here too.

    from heterps_ray.closedloop import run_job
    report = run_job(load_job("configs/jobs/quickstart.yaml"), overwrite=True)
"""

from heterps_ray.closedloop.report import REPORT_FILE, RunReport
from heterps_ray.closedloop.run import run_job

__all__ = ["REPORT_FILE", "RunReport", "run_job"]
