"""The Locust process: `python -m tokstream.loadgen.locust_run RUN.json`.

Started by `tokstream loadtest` as a child, because importing Locust monkey-patches the
process with gevent; nothing else (no server, no torch) ever lives here. RUN.json holds
everything (plain data). Each finished request is appended to the results file as one JSON
line the moment it ends, so a crash keeps what was measured. Stdout carries one JSON line
per second of progress, then a final line with Locust's own stats.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time

# Locust monkey-patches with gevent when imported: it comes first, before httpx opens sockets.
from locust import User, constant, task
from locust.env import Environment
from locust.exception import StopUser

import gevent
import gevent.event
import httpx

from tokstream.loadgen.mix import Mix, RunSettings, WorkloadClass
from tokstream.loadgen.plan import Limits
from tokstream.loadgen.prompts import PromptBook
from tokstream.loadgen.schedule import Schedule
from tokstream.loadgen.stream import auth_headers, new_sample, request_body, stream_request


MAX_BURST_USERS = 256


def emit(kind: str, payload: dict) -> None:
    sys.stdout.write(json.dumps({kind: payload}) + "\n")
    sys.stdout.flush()


class Run:
    """Shared state of one run (one process, cooperative greenlets: no locks needed)."""

    def __init__(self, config: dict):
        self.config = config
        raw = config["mix"]
        self.mix = Mix(raw["name"], raw["description"],
                       [WorkloadClass(**c) for c in raw["classes"]], raw["tenants"],
                       RunSettings(**raw["run"]))
        self.workloads = {c.name: c for c in self.mix.classes}
        self.book = PromptBook.from_row(config["book"])
        settings = config["settings"]
        self.schedule = Schedule(self.mix, Limits(**config["limits"]), config["seed"],
                                 settings["arrival"], settings["rate"], settings["burstiness"],
                                 settings["duration_s"], settings["requests"])
        self.results = open(config["results_path"], "a", encoding="utf-8")
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.in_flight = 0
        self.done = self.failed = self.output_tokens = 0
        self.http: httpx.Client | None = None
        self.events = None
        """The Locust Environment's events (set once it exists)."""
        self.users_started = 0
        self.users_left = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def send(self, client: httpx.Client, spec, scheduled_s: float | None) -> None:
        config = self.config
        workload = self.workloads[spec.workload]
        rng = random.Random(f"{config['seed']}:prompt:{spec.key}")
        body = request_body(config["api"], config["model"],
                            self.book.user_text(spec.workload, spec.prompt_tokens, rng),
                            self.book.system[spec.workload], spec.max_tokens,
                            workload.temperature, workload.ignore_eos)
        headers = auth_headers(config["api"], config["keys"].get(spec.tenant))
        row = {**spec.row(), "scheduled_s": scheduled_s, "start_s": self.elapsed()}
        self.in_flight += 1
        result = None
        try:
            result = stream_request(client, config["url"], config["api"], body, headers,
                                    config["request_timeout_s"])
        finally:
            self.in_flight -= 1
            if result is None:  # killed at the end of the run (drain timeout)
                result = {**new_sample("cancelled", "cancelled"),
                          "end_s": self.elapsed() - row["start_s"]}
            self.record({**row, **result})

    def record(self, sample: dict) -> None:
        if sample["status"] == "ok":
            self.done += 1
            self.output_tokens += sample["output_tokens"] or 0
        elif sample["status"] == "error":
            self.failed += 1
        self.results.write(json.dumps(sample) + "\n")
        self.results.flush()
        ttft = sample["event_times_s"][0] if sample["event_times_s"] else None
        failure = None if sample["status"] == "ok" else Exception(sample["error_type"])
        # Locust's own response time would stop at the headers: give it the stream's times.
        self.events.request.fire(request_type="stream", name=sample["workload"],
                            response_time=(sample["end_s"] or 0) * 1000,
                            response_length=sample.get("output_tokens") or 0,
                            exception=failure, context={"tenant": sample["tenant"]})
        if ttft is not None:
            self.events.request.fire(request_type="ttft", name=sample["workload"],
                                response_time=ttft * 1000, response_length=0, exception=None,
                                context={"tenant": sample["tenant"]})

    def progress(self) -> dict:
        return {"elapsed_s": round(self.elapsed(), 2), "issued": self.schedule.issued,
                "completed": self.done, "failed": self.failed, "in_flight": self.in_flight,
                "output_tokens": self.output_tokens}


def user_classes(run: Run) -> list[type]:
    class StreamUser(User):
        abstract = True
        wait_time = constant(0)

        def on_start(self):
            self.http = run.http
            run.users_started += 1
            run.users_left += 1

        def leave(self):
            run.users_left -= 1
            raise StopUser()

    class ClosedUser(StreamUser):
        @task
        def one(self):
            spec = run.schedule.next_closed(run.elapsed())
            if spec is None:
                self.leave()
            run.send(self.http, spec, None)

    class TimedUser(StreamUser):
        abstract = True

        def take(self):
            raise NotImplementedError

        @task
        def one(self):
            item = self.take()
            if item is None:
                self.leave()
            at, spec = item
            gevent.sleep(max(0.0, at - run.elapsed()))
            run.send(self.http, spec, at)

    class OpenUser(TimedUser):
        def take(self):
            return run.schedule.next_timed_main()

    class BurstUser(TimedUser):
        def take(self):
            return run.schedule.next_burst()

    settings = run.config["settings"]
    classes = []
    ClosedUser.fixed_count = OpenUser.fixed_count = settings["users"]
    classes.append(ClosedUser if settings["arrival"] == "closed" else OpenUser)
    BurstUser.fixed_count = min(run.schedule.burst_requests, MAX_BURST_USERS)
    if BurstUser.fixed_count:
        classes.append(BurstUser)
    return classes


def main(path: str) -> None:
    config = json.loads(open(path, encoding="utf-8").read())
    run = Run(config)
    # The parent owns Ctrl-C: it asks this process to stop with SIGTERM, and the run then
    # cancels what is in flight, records it and reports like any other end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = gevent.event.Event()
    gevent.signal_handler(signal.SIGTERM, stop.set)
    classes = user_classes(run)
    total_users = sum(c.fixed_count for c in classes)
    # One client for all users (a connection each: they stream at once). A client per user
    # would build an SSL context per user, which stalls the spawn of hundreds of users.
    run.http = httpx.Client(timeout=httpx.Timeout(config["request_timeout_s"], connect=30.0),
                            limits=httpx.Limits(max_connections=total_users,
                                                max_keepalive_connections=total_users))
    env = Environment(user_classes=classes, host=config["url"])
    run.events = env.events
    runner = env.create_local_runner()
    web = None
    if config.get("web_port") is not None:
        web = env.create_web_ui("127.0.0.1", config["web_port"])
        emit("web", {"url": f"http://127.0.0.1:{config['web_port']}"})
    run.started, run.started_wall = time.monotonic(), time.time()
    emit("started", {"wall_s": run.started_wall, "users": total_users})
    runner.start(total_users, spawn_rate=max(total_users, 1))
    settings = config["settings"]
    limit_s = (settings["duration_s"] or float("inf")) + config["drain_timeout_s"]
    reported = 0.0
    while True:
        gevent.sleep(0.2)
        if run.elapsed() - reported >= config["progress_interval_s"]:
            emit("progress", run.progress())
            reported = run.elapsed()
        if run.users_started >= total_users and run.users_left <= 0 and run.in_flight == 0:
            break
        if run.elapsed() > limit_s or stop.is_set():
            break
    runner.quit()  # kills anything still in flight: its sample is recorded as cancelled
    run.results.close()
    run.http.close()
    stats = {f"{kind} {name}": {"requests": entry.num_requests,
                                "failures": entry.num_failures,
                                "median_ms": entry.median_response_time,
                                "avg_ms": entry.avg_response_time}
             for (name, kind), entry in env.stats.entries.items()}
    emit("done", {"elapsed_s": run.elapsed(), "locust_stats": stats, **run.progress()})
    if web is not None:
        web.stop()


if __name__ == "__main__":
    main(sys.argv[1])
