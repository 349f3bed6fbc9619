"""The soak's summary as a table: counts, a row per instance, the fault log and the
targets (table.md, and stdout at the end of `kvpush bench soak`)."""

from __future__ import annotations

from typing import Any

from kvpush.bench import faults as faultlib


def markdown(summary: dict[str, Any]) -> str:
    """The summary as two short tables and the fault list."""
    o = summary["outcomes"]
    skipped = sum(f["skipped"] for f in summary["faults"])
    lines = [
        "| requests | ok | failed | disconnected | hung | wrong / compared | unexplained "
        "| cause not named | faults (skipped) | rate /s | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        # The outcomes in the header's order: ok, failed, disconnected, hung.
        f"| {summary['requests']} | {' | '.join(str(n) for n in o.values())} "
        f"| {summary['wrong']} / {summary['compared']} | {summary['unexplained_failures']} "
        f"| {summary['failures_not_naming_cause']} | {len(summary['faults'])} ({skipped}) "
        f"| {summary['rate']:g} | {summary['seconds']:g} |",
        "",
        "| instance | role | restarts | sending | producing | receiving | RSS MiB settled → end "
        "| open files settled → end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i in summary["instances"]:
        state = i["state"]
        (rss0, rss1), (fds0, fds1) = i["rss_mib"], i["fds"]
        lines.append(
            f"| {i['name']} | {i['role']} | {i['restarts']} | {state.get('sending', '?')} "
            f"| {state.get('producing', '?')} | {state.get('receiving', '?')} "
            f"| {rss0:.0f} → {rss1:.0f} | {fds0} → {fds1} |"
        )
    lines.append("")
    lines += [f"- fault {faultlib.Fault(**f).line()}" for f in summary["faults"]]
    lines.append("")
    lines += [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in summary["targets"].items()]
    return "\n".join(lines) + "\n"
