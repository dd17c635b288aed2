"""The header: what the server is (model, device, dtype, TP), how it is (replica status, ranks
with pid, memory and CPU, devices), how long it has been up and how fast it serves; the two
latency classes (which long prefill is held back behind short prompts, the long share); and
speculative decoding's acceptance when it is on; and top's own status (disconnected, paused,
sort and filter)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tokstream.core_state import Speculation
from tokstream.state_snapshot import PrefillPolicy, ReplicaStatus, StateSnapshot
from tokstream.top import format as fmt

STATUS_COLOUR = {ReplicaStatus.READY: "bold #98c379", ReplicaStatus.RECOVERING: "bold #e5c07b",
                 ReplicaStatus.DOWN: "bold #e06c75"}


def _known(value) -> str:
    return "?" if value is None else str(value)


def describe(state: StateSnapshot, url: str, prompt_rate: float | None,
             output_rate: float | None, recent_acceptance: float | None = None) -> Text:
    replica = state.replica
    status = replica.status
    text = Text()
    text.append("tokstream top ", style="bold").append(url, style="underline")
    text.append(f"  {_known(replica.model)}  {_known(replica.device)} "
                f"{_known(replica.dtype)}  TP {_known(replica.tp)}  ")
    text.append(f"● {status}", style=STATUS_COLOUR.get(status, "bold"))
    text.append(f"  restarts {replica.restarts}  up "
                f"{fmt.seconds(replica.uptime_s)}  prompt "
                f"{fmt.number(prompt_rate)} tok/s  output {fmt.number(output_rate)} tok/s")
    text.append("\n")
    for rank in state.ranks:
        alive = rank.alive
        text.append(f"rank{rank.rank} ", style="bold")
        text.append("●" if alive else "✖", style="#98c379" if alive else "#e06c75")
        text.append(f" pid {rank.pid} {fmt.size(rank.rss_bytes)} "
                    f"{fmt.number(rank.cpu_percent)}% CPU   ")
    for device in state.memory.devices:
        text.append(f"gpu{device.index} {fmt.size(device.used_bytes)}/"
                    f"{fmt.size(device.total_bytes)} {fmt.number(device.utilization_percent)}"
                    "% util   ")
    text.append(f"engine pid {state.engine.pid}  gateway pid {state.gateway.pid}", style="dim")
    policy = state.batch.prefill_policy
    if policy:  # a core that reports its prefill policy
        text.append("\n").append_text(describe_policy(policy))
    if speculating(state.speculation):
        text.append("\n").append_text(describe_speculation(state.speculation,
                                                           recent_acceptance))
    return text


def speculating(spec: Speculation) -> bool:
    """Speculation is on (an older core sends no section: it reads as off)."""
    return bool(spec.method) and spec.method != "off"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def describe_speculation(spec: Speculation, recent: float | None) -> Text:
    """One line: the method and k, tokens accepted of those drafted since the core started,
    the acceptance between the last two polls (recent), and per draft position the share of
    drafts accepted there (vLLM's per-position acceptance)."""
    text = Text()
    text.append("speculation ", style="bold")
    text.append(f"{spec.method} k={spec.num_speculative_tokens}")
    drafted, accepted = spec.num_draft_tokens or 0, spec.num_accepted_tokens or 0
    overall = accepted / drafted if drafted else None
    text.append(f"  accepted {fmt.number(accepted)}/{fmt.number(drafted)} drafted tokens")
    text.append(f" {_share(overall)}", style="bold #98c379" if overall else "")
    text.append(f" since start, {_share(recent)} last poll")
    if spec.num_drafts and spec.accepted_per_position:
        text.append("  by position " + " ".join(
            _share(count / spec.num_drafts) for count in spec.accepted_per_position))
    return text


def describe_policy(policy: PrefillPolicy) -> Text:
    """One line: the long prefills now (held back behind short prompts, or first because they
    are behind their share), the held one with the most left, their share of the last
    second's prefill time against the guarantee, the step time their chunks keep to."""
    rows, held = policy.long_prefills, policy.held
    text = Text()
    text.append("long prefills ", style="bold").append(str(len(rows)))
    if policy.long_first:
        text.append(" first", style="bold #e5c07b")
    elif held:
        row = max(held, key=lambda r: r.left_tokens)
        text.append(f" {len(held)} held", style="bold #61afef")
        text.append(f" (most left: {row.id} {fmt.number(row.left_tokens)} tokens)")
    share = "-" if policy.long_share is None else f"{policy.long_share:.0%}"
    limit = ("own steps, gaps ≤" if policy.long_prefill_alone else "chunks ≤") \
        + fmt.ms(policy.long_step_ms)
    text.append(f"  share {share} of prefill, {policy.long_prefill_share:.0%} guaranteed"
                f"  {limit}  long past "
                f"{fmt.number(policy.long_prefill_tokens)} tokens")
    return text


class Header(Static):
    DEFAULT_CSS = """
    Header { height: auto; max-height: 8; background: $panel; padding: 0 1; }
    """

    def show(self, state: StateSnapshot | None, url: str, prompt_rate: float | None,
             output_rate: float | None, notice: Text,
             recent_acceptance: float | None = None) -> None:
        text = describe(state, url, prompt_rate, output_rate, recent_acceptance) if state \
            else Text(f"tokstream top {url}", style="bold")
        self.update(text + Text("\n") + notice)
