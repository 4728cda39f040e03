"""Numbers behind one-pass calibration: the tau for a replay target as a TAS quantile, and the confidence
interval of a mean replay ratio over prompts (replay varies a lot from prompt to prompt, so a handful of
calibration prompts pins tau only loosely; the interval says how loosely)."""

from __future__ import annotations

import math

import numpy as np

# two-sided 95% Student-t quantiles for 1..30 degrees of freedom (normal beyond)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def ci95(values: np.ndarray) -> float:
    """Half width of the 95% confidence interval of the mean of `values` (Student t); nan below 2 values."""
    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return float("nan")
    df = v.size - 1
    z = 1.959964
    # Cornish-Fisher expansion of the t quantile beyond the table (error < 1e-4 for df > 30)
    t = _T975[df - 1] if df <= len(_T975) else z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
    return float(t * v.std(ddof=1) / math.sqrt(v.size))


def tau_for_share(tas_eligible: np.ndarray, share: float) -> float:
    """The tau at which `share` of the given TAS values are strictly above it (replay is TAS > tau)."""
    t = np.sort(np.asarray(tas_eligible, dtype=np.float64).ravel())
    if t.size == 0:
        raise ValueError("no eligible TAS values recorded")
    share = min(max(share, 0.0), 1.0)
    k = int(round(share * t.size))  # replay the k largest
    if k <= 0:
        return float(np.nextafter(t[-1], np.inf))
    if k >= t.size:
        return float(np.nextafter(t[0], -np.inf))
    return float(0.5 * (t[t.size - k - 1] + t[t.size - k]))  # between the (k+1)-th and k-th largest
