"""The problem's `runtime` section (DESIGN.md §3b) fitted from a profile: the job's execution, the PS
wait per row, the GPU tier's per-row times, the PS type's disk per row its shards' RAM misses, each
type's layer times calibrated to its one-stage runtime probe, each callee's call time from the
two-stage probes, and the machines whose cores types share."""

from __future__ import annotations

from typing import Any

import pandas as pd

from heterps_ray.profiling.fit_lines import round6

_PROBE_SCALE = (0.25, 4.0)  # a runtime/profile time ratio outside this is a broken measurement: clipped


def runtime_terms(
    problem: dict[str, Any],
    measurements: pd.DataFrame,
    execution: dict[str, Any],
    quality: list[dict[str, Any]],
) -> dict[str, Any]:
    """The problem's `runtime` section (DESIGN.md §3b): the job's execution, the PS wait per row, and
    what the runtime probes (probes.py) measured:

    * a one-stage probe on each type calibrates that type's layer times to the runtime (a single
      actor's timing leaves out what the runtime's DataWorker adds, and a burst of load during the
      profile skews it; the probe runs the real loop): they are scaled, and the type's fused saving
      with them, so that the plan takes the probe's ms per batch (the hosted PS's work included), the
      factor kept in the fit table;
    * then each two-stage probe gives its callee type's `call_ms`: what one call a batch took beyond
      what the calibrated layers, bytes and input explain.

    Changes `problem`'s layer times in place."""
    from heterps_ray.costmodel import CostModel, problem_from_dict

    terms: dict[str, Any] = {**execution}
    sel = measurements[measurements["kind"] == "ps"]
    if not sel.empty:  # a DataWorker waits for its pull, and its next pull queues behind its push
        terms["ps_wait_ms_per_row"] = round6(float(sel["ms"].sum() / (sel["rows"] * sel["calls"]).sum()))
    for kind, term in (("gpu_table", "gpu_table_ms_per_row"), ("gpu_miss", "gpu_miss_ms_per_row")):
        sel = measurements[(measurements["kind"] == kind) & (measurements["rows"] > 0)]
        if not sel.empty:  # the GPU tier of each cuda type (rows in its memory), per row
            per_type = sel.groupby("resource")[["ms", "rows"]].sum()
            terms[term] = {name: round6(float(r["ms"] / r["rows"])) for name, r in per_type.iterrows()}
    disk = measurements[measurements["kind"] == "disk"]
    for _, row in disk.iterrows():  # the PS type's disk, each setting timed (ps/disk_timing.py)
        quality.append({"what": "disk", "layer": f"{row['peer']} x{row['calls']}", "resource": row["resource"],
                        "slope_ms": row["ms"] / row["rows"], "flags": ""})  # fmt: skip
    misses = disk[disk["peer"] == "miss"]
    if not misses.empty:  # a row the shards' RAM misses: read back cold, and one written out for it
        terms["disk_ms_per_row"] = round6(float(misses["ms"].sum() / misses["rows"].sum()))
    probes = measurements[measurements["kind"] == "probe"]
    if probes.empty:
        return terms
    # each one-stage probe's spread over its runs (the profile's own): half its range over its median
    alone = probes[probes["peer"] == ""].groupby("resource", sort=False)["ms"]
    spread = ((alone.max() - alone.min()) / (2.0 * alone.median())).to_dict()
    terms["spread"] = {name: round6(float(s)) for name, s in spread.items() if alone.size()[name] > 1}
    # each probe's median over its runs (and over several profiles taken together)
    probes = probes.assign(fetched=probes["rows"] / probes["calls"].clip(lower=1))  # a GPU tier's, per batch
    probes = probes.groupby(["resource", "peer", "layer"], as_index=False, sort=False)[
        ["ms", "fetched"]
    ].median()
    layer_names = [layer["name"] for layer in problem["layers"]]
    fitted: dict[str, Any] = {"mode": "sync", "ps_wait_ms_per_row": terms.get("ps_wait_ms_per_row", 0.0),
              "call_ms": {r["name"]: 0.0 for r in problem["resources"]},
              **{k: terms[k] for k in ("gpu_table", "gpu_table_ms_per_row", "gpu_miss_ms_per_row") if k in terms}}  # fmt: skip

    def explained_ms(row: Any) -> tuple[float, float]:
        """(the probe plan's loop ms, of it the layers' compute) under the terms fitted so far, with the
        cold misses of its GPU tier (the rows it fetched, met for the first time: a long run's are priced by
        its hit rate)."""
        split = layer_names.index(row["layer"]) + 1
        caller = row["peer"] or row["resource"]
        assignment = [caller] * split + [row["resource"]] * (len(layer_names) - split)
        model = CostModel(problem_from_dict({**problem, "runtime": fitted}))
        stages = model.split_stages(assignment)
        limits = model.evaluate(assignment, [1] * len(stages), 1).runtime
        assert limits is not None
        compute = sum(float(model.compute_ms[start:end, t].sum()) for start, end, t in stages)
        cold = 0.0
        if limits.table.place != "ps":
            cold = float(row["fetched"]) * fitted.get("gpu_miss_ms_per_row", {}).get(caller, 0.0)
        return limits.loop_ms + cold, compute

    for _, row in probes[probes["peer"] == ""].iterrows():
        explained, compute = explained_ms(row)
        scale = (row["ms"] - (explained - compute)) / compute if compute > 0 else 1.0
        scale = min(max(scale, _PROBE_SCALE[0]), _PROBE_SCALE[1])
        for layer in problem["layers"]:
            coeffs = layer["time_ms"].get(row["resource"])
            if coeffs is not None:
                coeffs.update(
                    fixed=round6(coeffs["fixed"] * scale), per_sample=round6(coeffs["per_sample"] * scale)
                )
        for resource in problem["resources"]:  # a share of the layers' fixed times: it scales with them
            if resource["name"] == row["resource"] and "fused_saving_ms" in resource:
                resource["fused_saving_ms"] = round6(resource["fused_saving_ms"] * scale)
        flag = (
            ""
            if _PROBE_SCALE[0] < scale < _PROBE_SCALE[1]
            else f"runtime/profile time ratio clipped to {scale:g}"
        )
        quality.append({"what": "probe", "layer": row["layer"], "resource": row["resource"], "fixed_ms": row["ms"],
                        "slope_ms": explained, "layer_scale": scale, "flags": flag})  # fmt: skip
    for _, row in probes[probes["peer"] != ""].iterrows():
        explained, _ = explained_ms(row)
        fitted["call_ms"][row["resource"]] = max(row["ms"] - explained, 0.0)
        quality.append({"what": "probe", "layer": row["layer"], "resource": f"{row['peer']}->{row['resource']}",
                        "fixed_ms": row["ms"], "slope_ms": explained, "flags": ""})  # fmt: skip
    measured = set(probes.loc[probes["peer"] != "", "resource"])
    terms["call_ms"] = {name: round6(ms) for name, ms in fitted["call_ms"].items() if name in measured}
    return terms


def shared_hosts(measurements: pd.DataFrame) -> list[dict[str, Any]]:
    """Machines (Ray nodes) on which the actors of two or more types ran: their cores are shared.
    A type alone on its nodes is left out (a real cluster: each instance has its own cores)."""
    sel = measurements[measurements["kind"] == "host"]
    hosts: list[dict[str, Any]] = []
    for node, group in sel.groupby("peer", sort=True):
        types = list(dict.fromkeys(group["resource"]))
        if len(types) < 2:
            continue
        cores = float(group["rows"].min())
        # the least any window saw: load that comes and goes during a profile is not the background
        background = float((group["client_ms"] / group["ms"]).min())
        host = {
            "name": f"node{len(hosts)}",
            "cores": cores,
            "types": types,
            "background_cores": round6(min(background, 0.9 * cores)),
        }
        calls = measurements[(measurements["kind"] == "call_cpu") & (measurements["peer"] == node)]
        calls = calls[calls["client_ms"].notna()]
        if not calls.empty:  # the raylet's CPU per call
            daemons = calls["client_ms"].sum() / calls["calls"].sum()
            host["call_cpu_ms"] = round6(float(daemons))
        hosts.append(host)
    return hosts
