#!/usr/bin/env python3
"""Fits the rational function behind the CPU backend's f32 erfc (src/backend/cpu_vector_math.cpp).

erfcx(a) = exp(a^2) * erfc(a) is smooth and slowly varying on a >= 0 (from 1 at 0 down to
about 1/(a*sqrt(pi))), so a low-degree rational P(a)/Q(a) fits it to f32 precision, where
erfc itself, falling by 40 decades, could not be fitted. The kernel then takes
erfc(a) = exp(-a^2) * P(a)/Q(a).

The fit minimises the largest relative error |P/Q - f| / f over [0, A_MAX]:
  1. Loeb's iteration: the nonlinear least-squares problem in P and Q becomes a linear one
     by multiplying through by Q, with each row divided by the previous iteration's Q
     (so that the residual it minimises tends to the true one);
  2. Lawson's iteration on top: the rows are reweighted by the residual, which pushes the
     least-squares solution towards the minimax one (equal ripple).
Ground truth is mpmath's erfc at 40 digits, so the target carries no error of its own.

Run with Debian's python3 (python3-numpy, python3-mpmath):
    /usr/bin/python3 scripts/fit_erfcx.py
It prints the coefficients, lowest degree first, to 17 digits (the C++ evaluates P and Q in
double, Horner from the highest), and the largest relative error of P/Q on a grid 8x
denser than the fit's.
"""
import math
import sys

import mpmath
import numpy as np

DEG_P, DEG_Q = 4, 5
A_MAX = 9.5      # past 9.33, exp(-a^2) leaves f32's normal range and the kernel returns 0
N_FIT = 2000


def erfcx(a):
    mpmath.mp.dps = 40
    return np.array([float(mpmath.exp(mpmath.mpf(x) ** 2) * mpmath.erfc(mpmath.mpf(x)))
                     for x in a])


def design(a, f, q_prev):
    """Rows (P(a) - 1) - f*(Q(a) - 1) = f - 1, divided by f*Q_prev: a relative residual.
    P(0) = Q(0) = 1 are fixed, so that erfc(0) = 1 exactly."""
    cols = [a ** i for i in range(1, DEG_P + 1)] + [-f * a ** i for i in range(1, DEG_Q + 1)]
    scale = 1.0 / (f * q_prev)
    return np.stack(cols, axis=1) * scale[:, None], (f - 1) * scale


def coefficients(c):
    """P's and Q's coefficients, lowest degree first, from the fitted unknowns."""
    return np.concatenate(([1.0], c[:DEG_P])), np.concatenate(([1.0], c[DEG_P:]))


def evaluate(c, a):
    p, q = coefficients(c)
    pa, qa = np.polyval(p[::-1], a), np.polyval(q[::-1], a)
    return pa / qa, qa


def fit(a, f):
    q = np.ones_like(a)
    w = np.ones_like(a)
    c = None
    for it in range(200):
        m, rhs = design(a, f, q)
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(m * sw[:, None], rhs * sw, rcond=None)
        r, q = evaluate(c, a)
        err = np.abs(r / f - 1)
        if it >= 20:  # Loeb first, then Lawson's reweighting towards equal ripple
            w = w * err
            w /= w.sum()
    return c


def main():
    # Chebyshev-like spacing: denser near the ends, where a minimax error peaks
    t = np.linspace(0, math.pi, N_FIT)
    a = A_MAX * (1 - np.cos(t)) / 2
    f = erfcx(a)
    c = fit(a, f)
    p, q = coefficients(c)
    print("P (a^0 .. a^%d):" % DEG_P, ", ".join("%.17g" % x for x in p))
    print("Q (a^0 .. a^%d):" % DEG_Q, ", ".join("%.17g" % x for x in q))
    if (p < 0).any() or (q < 0).any():
        print("warning: a negative coefficient (the kernel relies on none, so that Horner's "
              "sums never cancel for a >= 0)", file=sys.stderr)
    # check on a denser grid, with the coefficients as printed
    dense = np.linspace(0, A_MAX, 8 * N_FIT)
    cr = np.array([float("%.17g" % x) for x in c])
    r, _ = evaluate(cr, dense)
    fd = erfcx(dense)
    print("largest relative error on [0, %g]: %.3g (%.3g f32 ulp)" %
          (A_MAX, np.abs(r / fd - 1).max(), np.abs(r / fd - 1).max() / 2 ** -24))


if __name__ == "__main__":
    main()
