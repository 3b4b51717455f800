// Deterministic elementary functions in IEEE-754 double precision, built only
// from +, -, *, / (each correctly rounded) and exact power-of-two scaling.
// With contraction off (-ffp-contract=off, the project default) they return
// the same bits on every conforming machine, unlike libm, whose exp/log may
// differ in the last place between versions.  The codec's threshold and
// reconstruction tables (codec/codebook.cc) are computed with them, so an
// encoder and a decoder on different machines, and the CUDA kernels (which
// receive the same tables from the host), agree bit for bit.
#pragma once

namespace kvxfer::detmath {

/** ln(1 + x) for x >= 0 (x up to 1e6).  Relative error below 1e-15. */
double log1p(double x);

/** exp(x) - 1 for |x| <= 16.  Relative error below 1e-14. */
double expm1(double x);

}  // namespace kvxfer::detmath
