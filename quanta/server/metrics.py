"""/metrics: the engine's state and serving statistics in Prometheus' text exposition format, with
vLLM's metric names under the `quanta:` prefix so dashboards carry over."""
from __future__ import annotations

from quanta.engine.drivers.client import EngineClient
from quanta.engine.drivers.stats import Histogram


def _family(lines: list[str], name: str, kind: str, help_text: str) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _label(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _histogram(lines: list[str], name: str, help_text: str, h: Histogram, labels: dict[str, str]) -> None:
    _family(lines, name, "histogram", help_text)
    for bound, count in zip(h.bounds, h.counts):
        lines.append(f"{name}_bucket{_label(labels | {'le': repr(float(bound))})} {count}")
    lines.append(f"{name}_bucket{_label(labels | {'le': '+Inf'})} {h.count}")
    lines.append(f"{name}_sum{_label(labels)} {h.total}")
    lines.append(f"{name}_count{_label(labels)} {h.count}")


def render(engine: EngineClient, model_name: str) -> str:
    """The metrics page."""
    stats, g = engine.stats, engine.gauges()
    labels = {"model_name": model_name}
    lb = _label(labels)
    lines: list[str] = []
    gauges = [
        ("quanta:engine_healthy", "1 while the engine runs, 0 once it has stopped (the server then exits).",
         int(engine.healthy)),
        ("quanta:num_requests_running", "Sequences in the running batch.", g["running"]),
        ("quanta:num_requests_waiting", "Sequences waiting to be scheduled.", g["waiting"]),
        ("quanta:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).",
         1.0 - g["free_blocks"] / g["total_blocks"]),
        ("quanta:kv_cache_free_blocks", "KV-cache blocks on the free list.", g["free_blocks"]),
        ("quanta:kv_cache_total_blocks", "KV-cache blocks in the pool.", g["total_blocks"]),
    ]
    for name, help_text, value in gauges:
        _family(lines, name, "gauge", help_text)
        lines.append(f"{name}{lb} {value}")
    counters = [
        ("quanta:num_preemptions_total", "Sequences preempted (recomputed later).", g["preemptions"]),
        ("quanta:prompt_tokens_total", "Prompt tokens of the requests added.", stats.prompt_tokens),
        ("quanta:generation_tokens_total", "Output tokens generated.", stats.generation_tokens),
    ]
    for name, help_text, value in counters:
        _family(lines, name, "counter", help_text)
        lines.append(f"{name}{lb} {value}")
    _family(lines, "quanta:request_success_total", "counter", "Requests finished, by finish reason.")
    for reason in sorted(set(stats.finished) | {"stop", "length", "abort"}):
        lines.append(f"quanta:request_success_total{_label(labels | {'finished_reason': reason})} "
                     f"{stats.finished.get(reason, 0)}")
    _histogram(lines, "quanta:time_to_first_token_seconds", "Time to the first output token.", stats.ttft, labels)
    _histogram(lines, "quanta:time_per_output_token_seconds", "Mean time per output token after the first.",
               stats.tpot, labels)
    _histogram(lines, "quanta:e2e_request_latency_seconds", "Arrival to finish of a request.", stats.e2e, labels)
    return "\n".join(lines) + "\n"
