"""The header: what the server is (model, device, dtype, TP), how it is (replica status, ranks
with pid, memory and CPU, devices), how long it has been up and how fast it serves; and top's
own status (disconnected, paused, sort and filter)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tokstream.top import format as fmt

STATUS_COLOUR = {"ready": "bold #98c379", "recovering": "bold #e5c07b", "down": "bold #e06c75"}


def describe(state: dict, url: str, prompt_rate: float | None,
             output_rate: float | None) -> Text:
    replica = state.get("replica", {})
    status = replica.get("status", "?")
    text = Text()
    text.append("tokstream top ", style="bold").append(url, style="underline")
    text.append(f"  {replica.get('model', '?')}  {replica.get('device', '?')} "
                f"{replica.get('dtype', '?')}  TP {replica.get('tp', '?')}  ")
    text.append(f"● {status}", style=STATUS_COLOUR.get(status, "bold"))
    text.append(f"  restarts {replica.get('restarts', 0)}  up "
                f"{fmt.seconds(replica.get('uptime_s'))}  prompt "
                f"{fmt.number(prompt_rate)} tok/s  output {fmt.number(output_rate)} tok/s")
    text.append("\n")
    for rank in state.get("ranks", []):
        alive = rank.get("alive")
        text.append(f"rank{rank['rank']} ", style="bold")
        text.append("●" if alive else "✖", style="#98c379" if alive else "#e06c75")
        text.append(f" pid {rank.get('pid')} {fmt.size(rank.get('rss_bytes'))} "
                    f"{fmt.number(rank.get('cpu_percent'))}% CPU   ")
    for device in state.get("memory", {}).get("devices", []):
        util = device.get("utilization_percent")
        text.append(f"gpu{device['index']} {fmt.size(device.get('used_bytes'))}/"
                    f"{fmt.size(device.get('total_bytes'))} {fmt.number(util)}% util   ")
    engine = state.get("engine", {})
    text.append(f"engine pid {engine.get('pid')}  gateway pid "
                f"{state.get('gateway', {}).get('pid')}", style="dim")
    return text


class Header(Static):
    DEFAULT_CSS = """
    Header { height: auto; max-height: 8; background: $panel; padding: 0 1; }
    """

    def show(self, state: dict, url: str, prompt_rate: float | None,
             output_rate: float | None, notice: Text) -> None:
        text = describe(state, url, prompt_rate, output_rate) if state else Text(
            f"tokstream top {url}", style="bold")
        self.update(text + Text("\n") + notice)
