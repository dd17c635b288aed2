"""What a step costs, learned online from the steps the engine has run. Pure Python, no torch.

    seconds ~ a + b * decodes + c * prefill_tokens + d * attended_tokens      (decode-only step)
    seconds ~ a + e + f * decodes + c * prefill_tokens + d * attended_tokens  (carries prefill)

`attended_tokens` counts (query, key) pairs: a decode at context n attends n keys; a prefill
chunk of n tokens from position s attends n*s + n(n+1)/2, which is what makes a chunk deep in
a 50k-token prompt cost many times one at its start. The fit is an exponentially weighted least
squares, so it follows a machine that gets slower or faster (other processes, thermal limits),
with three guards: coefficients stay >= 0; a term the recent steps do not exercise (no prefill
for a while) keeps its last value instead of fading to zero; and a step far off the prediction
(a pause, a recompile) counts less (Huber weights).

A step that carries prefill has its own fixed cost `e` and cost per decode `f`: on CPU a
decode-only step runs every layer in one C call, and a step with a chunk in it takes the
per-layer path (measured on SmolLM2: ~15 ms more a step, and more a decode), so a fit of one
kind of step averaged the two and steps carrying prefill overran a 100 ms target by a third at
the 99th percentile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FEATURE_SCALES = (1.0, 64.0, 1024.0, float(1 << 20), 1.0, 64.0)
"""A typical size of each feature (intercept, decodes of a decode-only step, prefill tokens,
attended pairs, carries prefill, decodes of a step that carries prefill); the fit works on
features divided by these so its equations stay well conditioned."""
NUM_FEATURES = len(FEATURE_SCALES)
MIN_PREFILL_TOKEN_S = 1e-6
"""The least a prompt token is taken to cost when sizing a chunk (a real model's is 100x more)."""
PROBE_PREFILL_TOKENS = 64
"""The largest chunk sized from the fit before it has seen a step carry that many prompt
tokens (see EXTRAPOLATION)."""
EXTRAPOLATION = 2.0
"""A chunk sized from the fit holds at most this many times the most prompt tokens a measured
step has carried: past what it has seen the fit is a guess. Measured (SmolLM2, 2 cores): after
one 80-token warm-up prefill the fit put 0.1 s in the fixed cost of carrying prefill and 8 us
a token, so a 150 ms ITL target "fitted" a 1,000-token prompt in one step that took 2.6 s,
and two streams decoding beside it waited that long. Growing by this factor, a chunk that size
is three steps away, each measured, none far past the target."""


def attended_tokens(start: int, num_tokens: int) -> int:
    """(query, key) pairs a chunk of num_tokens from position start attends (causal)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def _seconds_per(feature: int, doc: str) -> property:
    """A read-only property: the fitted coefficient of feature (FEATURE_SCALES' order) in
    seconds per unit of that feature, i.e. divided back by its scale."""
    def unscaled(model: "StepCostModel") -> float:
        return model.coefficients[feature] / FEATURE_SCALES[feature]
    return property(unscaled, doc=doc)


@dataclass(frozen=True)
class StepShape:
    """What one step computes, as the cost model sees it."""

    num_decodes: int
    """Sequences that compute one token and sample it."""
    prefill_tokens: int
    """Tokens computed in prefill chunks."""
    attended_tokens: int
    """(query, key) pairs over every sequence in the step (see attended_tokens())."""

    def features(self) -> list[float]:
        mixed = self.prefill_tokens > 0
        raw = (1.0, 0 if mixed else self.num_decodes, self.prefill_tokens, self.attended_tokens,
               1.0 if mixed else 0.0, self.num_decodes if mixed else 0)
        return [value / scale for value, scale in zip(raw, FEATURE_SCALES)]


@dataclass
class StepCostModel:
    """Step time as a linear function of a step's shape, fitted as steps complete."""

    decay: float = 0.95
    """Weight a past step keeps at each new one: the fit remembers ~1 / (1 - decay) steps."""
    ridge: float = 1e-3
    """Pull toward the previous coefficients (in scaled units); negligible wherever recent
    steps say something, decisive where they say nothing."""
    intercept_ridge: float = 0.3
    """The same pull on the fixed cost, stronger: while the first steps cannot tell fixed cost
    from work, time goes to the work terms, which over- rather than under-predicts a step
    with more work than those (a cold start errs toward small prefill chunks)."""
    huber: float = 4.0
    """A residual past this many typical residuals gets weight huber * typical / |residual|."""
    min_relative_noise: float = 0.05
    """Floor of the typical residual as a share of the prediction: real step times jitter by
    a few percent, and without it an exact fit would ignore a genuine slowdown."""
    robust_after: int = 8
    """Observations before Huber weights apply (the first ones are the fit)."""
    num_observations: int = 0
    largest_prefill_tokens: int = 0
    """The most prompt tokens one measured step carried (never forgotten: what the fit may
    extrapolate from, prefill_tokens_within)."""
    coefficients: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    """Seconds per scaled feature (FEATURE_SCALES' order)."""
    typical_residual_s: float = 0.0
    """Exponentially weighted mean absolute residual, in seconds."""
    _xtx: list[list[float]] = field(
        default_factory=lambda: [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)])
    _xty: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)

    # The fit's coefficients unscaled, in seconds per unit of each feature (the formulas above).
    intercept_s = _seconds_per(0, "a: the fixed cost of every step.")
    per_decode_s = _seconds_per(1, "b: a decode in a decode-only step.")
    per_prefill_token_s = _seconds_per(2, "c: a token computed in a prefill chunk.")
    per_attended_token_s = _seconds_per(3, "d: a (query, key) pair attended.")
    prefill_step_s = _seconds_per(4, "e: what a step pays once for carrying any prefill, its "
                                     "decodes aside.")
    per_decode_with_prefill_s = _seconds_per(5, "f: a decode in a step that carries prefill.")

    def prefill_switch_seconds(self, num_decodes: int) -> float:
        """What a step of num_decodes decodes pays, once, for carrying prefill: the fixed cost
        and the dearer decodes (never taken as a saving)."""
        extra = self.per_decode_with_prefill_s - self.per_decode_s
        return max(0.0, self.prefill_step_s + extra * num_decodes)

    def predict(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features()))

    def decode_seconds(self, num_decodes: int, attended: int) -> float:
        """Predicted time of a step that only decodes (its fixed cost included)."""
        return self.predict(StepShape(num_decodes, 0, attended))

    def prefill_seconds(self, start: int, num_tokens: int) -> float:
        """Predicted time a prefill chunk adds to a step that already carries prefill (the
        first chunk adds prefill_switch_seconds too)."""
        return (self.per_prefill_token_s * num_tokens
                + self.per_attended_token_s * attended_tokens(start, num_tokens))

    def prefill_tokens_within(self, seconds: float, start: int) -> int:
        """Most tokens of a chunk from position start whose predicted cost fits in seconds,
        and no more than EXTRAPOLATION times what a measured step has carried."""
        if seconds <= 0:
            return 0
        seen = max(PROBE_PREFILL_TOKENS, int(EXTRAPOLATION * self.largest_prefill_tokens))
        return min(seen, self._tokens_predicted_within(seconds, start))

    def _tokens_predicted_within(self, seconds: float, start: int) -> int:
        # seconds = c*n + d*(n*start + n(n+1)/2): the positive root of the quadratic in n,
        # written 2s / (l + sqrt(l^2 + 2ds)) so a tiny d does not cancel it to zero.
        # A token never costs nothing: a fit that puts every prefill step's cost in its fixed
        # term (a tiny model) must not read as unlimited room.
        c, d = max(self.per_prefill_token_s, MIN_PREFILL_TOKEN_S), self.per_attended_token_s
        linear = c + d * (start + 0.5)
        denominator = linear + (linear * linear + 2 * d * seconds) ** 0.5
        return int(2 * seconds / denominator) if denominator > 0 else 1 << 62

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Fold in one measured step."""
        x = shape.features()
        self.largest_prefill_tokens = max(self.largest_prefill_tokens, shape.prefill_tokens)
        weight = 1.0
        if self.num_observations:
            predicted = self.predict(shape)
            residual = abs(seconds - predicted)
            typical = max(self.typical_residual_s, self.min_relative_noise * max(predicted, 0.0))
            if self.num_observations >= self.robust_after and residual > self.huber * typical:
                weight = self.huber * typical / residual
            self.typical_residual_s = (self.decay * self.typical_residual_s
                                       + (1 - self.decay) * residual)
        for i in range(NUM_FEATURES):
            self._xty[i] = self.decay * self._xty[i] + weight * x[i] * seconds
            row = self._xtx[i]
            for j in range(NUM_FEATURES):
                row[j] = self.decay * row[j] + weight * x[i] * x[j]
        self.num_observations += 1
        self.coefficients = self._solve()

    def _solve(self) -> list[float]:
        """Ridge toward the previous coefficients, none below zero: drop the most negative
        term and solve again until all are >= 0 (at most one solve a term)."""
        free = list(range(NUM_FEATURES))
        while free:
            ridge = [self.intercept_ridge] + [self.ridge] * (NUM_FEATURES - 1)
            a = [[self._xtx[i][j] + (ridge[i] if i == j else 0.0) for j in free] for i in free]
            b = [self._xty[i] + ridge[i] * self.coefficients[i] for i in free]
            solution = _solve_linear(a, b)
            worst = min(range(len(free)), key=solution.__getitem__)
            if solution[worst] >= 0:
                coefficients = [0.0] * NUM_FEATURES
                for i, value in zip(free, solution):
                    coefficients[i] = value
                return coefficients
            del free[worst]
        return [0.0] * NUM_FEATURES


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a is symmetric positive definite here (the
    ridge term), so a pivot is never zero."""
    n = len(b)
    m = [row[:] + [value] for row, value in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= factor * m[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
