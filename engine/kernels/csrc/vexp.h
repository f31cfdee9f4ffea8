// e^x on a vector ISA's primitives (isa.h), included in avx2_isa and
// avx512_isa: e^x = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2, e^r by
// its Taylor polynomial to degree 6 (relative error about 2e-7, as libm's
// expf; scalar_isa takes std::exp itself). No include guard: once per ISA.

inline Vec vexp(Vec x) {
  x = vmin(vmax(x, vset(-87.3f)), vset(88.7f));
  const Vec n = vround(vmul(x, vset(1.44269504f)));
  Vec r = vfnma(n, vset(0.693359375f), x);  // ln 2 in two parts: r exact to float32
  r = vfnma(n, vset(-2.12194440e-4f), r);
  Vec p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return vmul(p, vpow2(n));
}
