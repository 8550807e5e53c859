/* Three probes of the machine that bound the CPU decode attention kernel,
 * quoted by bench/NOTES.md ("Where decode attention's time goes on Zen 3"):
 *
 *   fma   the AVX2 FMA rate: 12 independent chains (the core's peak), 8
 *         chains with four 32-byte loads per eight FMAs (the score loop's
 *         mix), and one chain (its latency, from which the clock follows:
 *         4 cycles per FMA on Zen 3 and on Intel since Skylake);
 *   scores the kernel's score step (4 query rows x 2 fp16 keys, 8 FMA
 *         chains, a sum per row and key) over 256 MiB of keys in shuffled
 *         32 KiB pages: from L2, from memory, and from memory with the next
 *         page prefetched a page ahead (what its arithmetic costs, and how
 *         much of memory's time a simple loop hides);
 *   pages the read rate of 256 MiB in 32 KiB pages (a KV page of 16 fp16
 *         tokens x 8 heads x 128) in address order and in a shuffled
 *         order, each page read front to back.
 *
 * Build: gcc -O3 -mavx2 -mfma -mf16c bench/tools/cpu_probes.c -o /tmp/cpu_probes
 *        (-O3: at -O2 gcc keeps the score step's accumulator arrays in memory)
 * Run:   /tmp/cpu_probes fma ; /tmp/cpu_probes scores ; /tmp/cpu_probes pages
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define FMA(x) x = _mm256_fmadd_ps(x, b, c)

/* G FMA/s of 12 independent chains: the core's peak. */
__attribute__((noinline)) static double fma_peak(void) {
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  __m256 a0 = _mm256_set1_ps(1), a1 = _mm256_set1_ps(2), a2 = _mm256_set1_ps(3), a3 = _mm256_set1_ps(4),
         a4 = _mm256_set1_ps(5), a5 = _mm256_set1_ps(6), a6 = _mm256_set1_ps(7), a7 = _mm256_set1_ps(8),
         a8 = _mm256_set1_ps(9), a9 = _mm256_set1_ps(10), a10 = _mm256_set1_ps(11), a11 = _mm256_set1_ps(12);
  const long n = 200000000;
  const double t0 = now();
  for (long i = 0; i < n; ++i) {
    FMA(a0); FMA(a1); FMA(a2); FMA(a3); FMA(a4); FMA(a5);
    FMA(a6); FMA(a7); FMA(a8); FMA(a9); FMA(a10); FMA(a11);
    __asm__("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8),
            "+x"(a9), "+x"(a10), "+x"(a11));
  }
  const double rate = n * 12 / (now() - t0) / 1e9;
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                                                 _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11))));
  return sum[0] > 0 ? rate : -rate;
}

/* G FMA/s of the score loop's mix: 8 chains (4 query rows x 2 keys), the
 * four query vectors loaded from L1 for every eight FMAs. */
__attribute__((noinline)) static double fma_with_loads(void) {
  static float q[4][128] __attribute__((aligned(64)));
  for (int r = 0; r < 4; ++r)
    for (int d = 0; d < 128; ++d) q[r][d] = 1e-3f * (float)(d + r);
  const __m256 k0 = _mm256_set1_ps(0.999f), k1 = _mm256_set1_ps(0.001f);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const long m = 20000000;
  const double t0 = now();
  for (long i = 0; i < m; ++i) {
    for (int d = 0; d < 128; d += 8) {
      __m256 q0 = _mm256_load_ps(q[0] + d), q1 = _mm256_load_ps(q[1] + d), q2 = _mm256_load_ps(q[2] + d),
             q3 = _mm256_load_ps(q[3] + d);
      __asm__("" : "+x"(q0), "+x"(q1), "+x"(q2), "+x"(q3));
      a0 = _mm256_fmadd_ps(k0, q0, a0); a1 = _mm256_fmadd_ps(k0, q1, a1);
      a2 = _mm256_fmadd_ps(k0, q2, a2); a3 = _mm256_fmadd_ps(k0, q3, a3);
      a4 = _mm256_fmadd_ps(k1, q0, a4); a5 = _mm256_fmadd_ps(k1, q1, a5);
      a6 = _mm256_fmadd_ps(k1, q2, a6); a7 = _mm256_fmadd_ps(k1, q3, a7);
    }
  }
  const double rate = m * 16.0 * 8 / (now() - t0) / 1e9;
  const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                   _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  return sum[0] > 0 ? rate : -rate;
}

/* ns per FMA of one dependent chain: its latency. */
__attribute__((noinline)) static double fma_latency_ns(void) {
  const __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
  __m256 x = _mm256_set1_ps(1);
  const long n = 200000000;
  const double t0 = now();
  for (long i = 0; i < n; ++i) FMA(x);
  const double ns = (now() - t0) / n * 1e9;
  return x[0] > 0 ? ns : -ns;
}

static void fma_probe(void) {
  const double peak = fma_peak(), mixed = fma_with_loads(), ns = fma_latency_ns();
  printf("FMA peak (12 chains): %.2f G/s; score-loop mix (8 chains + 4 loads per 8 FMAs): %.2f G/s; "
         "one chain: %.3f ns per FMA (%.2f GHz at 4 cycles)\n", peak, mixed, ns, 4.0 / ns);
}

enum { kPage = 32 * 1024, kPages = 8192 };

static float read_page(const char* p) {
  __m256 a = _mm256_setzero_ps(), b = a;
  for (long o = 0; o < kPage; o += 64) {
    a = _mm256_add_ps(a, _mm256_loadu_ps((const float*)(p + o)));
    b = _mm256_add_ps(b, _mm256_loadu_ps((const float*)(p + o + 32)));
  }
  return _mm256_add_ps(a, b)[0];
}

static void pages_probe(void) {
  char* buf = aligned_alloc(2 << 20, (size_t)kPage * kPages);
  madvise(buf, (size_t)kPage * kPages, MADV_HUGEPAGE);
  memset(buf, 0, (size_t)kPage * kPages);
  static int order[kPages];
  for (int shuffled = 0; shuffled <= 1; ++shuffled) {
    for (int i = 0; i < kPages; ++i) order[i] = i;
    srand(17);
    for (int i = kPages - 1; shuffled && i > 0; --i) {
      const int j = rand() % (i + 1), t = order[i];
      order[i] = order[j];
      order[j] = t;
    }
    double best = 1e9;
    float sink = 0;
    for (int rep = 0; rep < 15; ++rep) {
      const double t0 = now();
      for (int i = 0; i < kPages; ++i) sink += read_page(buf + (size_t)order[i] * kPage);
      const double t = now() - t0;
      if (t < best) best = t;
    }
    printf("256 MiB in 32 KiB pages, %s order: %.2f ms (%.1f GB/s) [%g]\n", shuffled ? "shuffled" : "address",
           best * 1e3, (double)kPage * kPages / best / 1e9, sink);
  }
  free(buf);
}

/* Scores 4 query rows against two fp16 keys of 128 (the kernel's R = 4,
 * K = 2 step: 8 FMA chains over head_dim, then one sum per row and key). */
static float g_q[4][128] __attribute__((aligned(64)));
static float g_scores[1 << 16];

static inline void score_two_keys(const unsigned short* k0, const unsigned short* k1, float* out) {
  __m256 a[2][4];
  for (int k = 0; k < 2; ++k)
    for (int r = 0; r < 4; ++r) a[k][r] = _mm256_setzero_ps();
  for (int d = 0; d < 128; d += 8) {
    __m256 q[4];
    for (int r = 0; r < 4; ++r) {
      q[r] = _mm256_load_ps(g_q[r] + d);
      __asm__("" : "+x"(q[r]));
    }
    const __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k0 + d)));
    const __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(k1 + d)));
    for (int r = 0; r < 4; ++r) {
      a[0][r] = _mm256_fmadd_ps(x0, q[r], a[0][r]);
      a[1][r] = _mm256_fmadd_ps(x1, q[r], a[1][r]);
    }
  }
  for (int k = 0; k < 2; ++k) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[k][0], a[k][1]), _mm256_hadd_ps(a[k][2], a[k][3]));
    _mm_storeu_ps(out + 4 * k, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

/* ms to score every key of `pages` shuffled 32 KiB pages (128 keys each),
 * front to back; with read_ahead, the next page is prefetched into L2 a
 * 1/64th per key pair, a whole page ahead. Best of `reps` passes. */
static double score_pages(const char* buf, const int* order, int pages, int reps, int read_ahead) {
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    const double t0 = now();
    for (int i = 0; i < pages; ++i) {
      const char* page = buf + (size_t)order[i] * kPage;
      const char* next = buf + (size_t)order[(i + 1) % pages] * kPage;
      for (int row = 0; row < 128; row += 2) {
        if (read_ahead)
          for (int line = 0; line < 8; ++line) _mm_prefetch(next + row * 256 + line * 64, _MM_HINT_T1);
        score_two_keys((const unsigned short*)(page + row * 256), (const unsigned short*)(page + row * 256 + 256),
                       g_scores + ((i * 64 + row / 2) * 8 & ((1 << 16) - 1)));
      }
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  return best * 1e3;
}

static void scores_probe(void) {
  char* buf = aligned_alloc(2 << 20, (size_t)kPage * kPages);
  madvise(buf, (size_t)kPage * kPages, MADV_HUGEPAGE);
  unsigned short* halves = (unsigned short*)buf;
  for (size_t i = 0; i < (size_t)kPage * kPages / 2; ++i) halves[i] = (unsigned short)(0x3c00 + (i & 1023));
  for (int r = 0; r < 4; ++r)
    for (int d = 0; d < 128; ++d) g_q[r][d] = 0.01f * (float)(r + d);
  static int order[kPages];
  for (int i = 0; i < kPages; ++i) order[i] = i;
  srand(17);
  for (int i = kPages - 1; i > 0; --i) {
    const int j = rand() % (i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  const double cached = score_pages(buf, order, 8, 4000, 0) * kPages / 8;  /* 256 KiB: in L2 */
  const double memory = score_pages(buf, order, kPages, 5, 0);
  const double ahead = score_pages(buf, order, kPages, 5, 1);
  const double fmas = (double)kPages * 64 * 128;
  printf("scoring 256 MiB of fp16 keys (4 rows x 2 keys a step): from L2 %.2f ms (%.2f G FMA/s), "
         "from memory %.2f ms, a page read ahead %.2f ms [%g]\n",
         cached, fmas / cached / 1e6, memory, ahead, g_scores[7]);
  free(buf);
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s fma|pages|scores\n", argv[0]);
    return 2;
  }
  if (strcmp(argv[1], "fma") == 0) {
    fma_probe();
  } else if (strcmp(argv[1], "pages") == 0) {
    pages_probe();
  } else if (strcmp(argv[1], "scores") == 0) {
    scores_probe();
  } else {
    fprintf(stderr, "usage: %s fma|pages|scores\n", argv[0]);
    return 2;
  }
  return 0;
}
