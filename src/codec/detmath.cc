#include "codec/detmath.h"

namespace kvxfer::detmath {

namespace {
constexpr double kLn2 = 0.6931471805599453094172321214581766;  // correctly rounded ln 2

// ln(m) for m in [sqrt(1/2), sqrt(2)] through ln(m) = 2 atanh(s), s = (m-1)/(m+1),
// |s| <= 0.1716, series to s^41 (error < 1e-30 relative to the result's scale).
double log_reduced(double m) {
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  double term = s, sum = 0.0;
  for (int k = 1; k <= 41; k += 2) {
    sum = sum + term / k;
    term = term * s2;
  }
  return 2.0 * sum;
}
}  // namespace

double log1p(double x) {
  // Write 1 + x = m * 2^e with m in [sqrt(1/2), sqrt(2)).  Scaling by 2 is exact.
  if (x < 1e-8) return x - 0.5 * x * x;  // |error| < x^3/3 < 1e-24 relative
  double m = 1.0 + x;
  int e = 0;
  while (m >= 1.4142135623730951) {
    m = m * 0.5;
    ++e;
  }
  // 1 + x rounds when x is tiny relative to 1; that case returned above.
  return log_reduced(m) + e * kLn2;
}

double expm1(double x) {
  // Halve until |x| < 2^-10, sum the Taylor series, then double back with
  // expm1(2y) = expm1(y) * (expm1(y) + 2), which keeps relative accuracy.
  int halvings = 0;
  double y = x;
  while (y > 0.0009765625 || y < -0.0009765625) {
    y = y * 0.5;
    ++halvings;
  }
  double term = y, sum = 0.0;
  for (int k = 2; k <= 12; ++k) {
    sum = sum + term;
    term = term * y / k;
  }
  for (int i = 0; i < halvings; ++i) sum = sum * (sum + 2.0);
  return sum;
}

}  // namespace kvxfer::detmath
