"""StepTimeModel.fit: exact on clean steps, and robust to the few steps a machine stalls on."""

from __future__ import annotations

import numpy as np
import pytest

from moefleet.sim.engine_sim import StepTimeModel


def _steps(rng: np.random.Generator, n: int) -> list[tuple[int, int, float]]:
    out = []
    for _ in range(n):
        tokens, rows = int(rng.integers(1, 128)), int(rng.integers(1, 8))
        out.append((tokens, rows, 2e-3 + 5e-5 * tokens + 3e-4 * rows))
    return out


def test_clean_steps_give_the_exact_coefficients() -> None:
    m = StepTimeModel.fit(_steps(np.random.default_rng(0), 50))
    assert (m.base_s, m.per_token_s, m.per_row_s) == pytest.approx((2e-3, 5e-5, 3e-4), rel=1e-6)


def test_stalled_steps_do_not_pull_the_fit_up() -> None:
    rng = np.random.default_rng(1)
    clean = _steps(rng, 200)
    noisy = [(t, r, s * float(rng.normal(1.0, 0.02))) for t, r, s in clean]
    for i in range(0, 200, 10):  # 10% of the steps stalled 5x (GC, another process)
        t, r, s = noisy[i]
        noisy[i] = (t, r, 5 * s)
    robust = StepTimeModel.fit(noisy)
    typical = [robust(t, r) / s for t, r, s in clean]
    assert np.median(typical) == pytest.approx(1.0, abs=0.03)
    # what plain least squares would have made of the same steps: clearly too slow
    a = np.array([[1.0, t, r] for t, r, _ in noisy])
    ols, *_ = np.linalg.lstsq(a, np.array([s for *_, s in noisy]), rcond=None)
    assert np.median([(ols @ [1.0, t, r]) / s for t, r, s in clean]) > 1.2


def test_too_few_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match=">= 3 measured steps"):
        StepTimeModel.fit([(1, 1, 0.1), (2, 1, 0.2)])
