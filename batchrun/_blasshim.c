/*
 * Forwarding shim: exports the cblas_*gemm symbols that MLX's CPU backend calls and
 * forwards them to an OpenBLAS whose symbols carry a prefix (PyPI's scipy-openblas32
 * exports scipy_cblas_sgemm).  batchrun/blas.py loads this library with RTLD_GLOBAL
 * before MLX, so the dynamic linker binds MLX to these definitions instead of the
 * bundled reference BLAS, then sets the targets from the OpenBLAS it loaded.
 *
 * The call counter lets batchrun verify that MLX's matmuls really arrive here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <complex.h>

typedef void (*sgemm_t)(int, int, int, int, int, int, float, const float *, int,
                        const float *, int, float, float *, int);
typedef void (*dgemm_t)(int, int, int, int, int, int, double, const double *, int,
                        const double *, int, double, double *, int);
typedef void (*cgemm_t)(int, int, int, int, int, int, const void *, const void *, int,
                        const void *, int, const void *, void *, int);

sgemm_t batchrun_sgemm_target = NULL;
dgemm_t batchrun_dgemm_target = NULL;
cgemm_t batchrun_cgemm_target = NULL;
unsigned long long batchrun_gemm_calls = 0;

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    __atomic_add_fetch(&batchrun_gemm_calls, 1, __ATOMIC_RELAXED);
    batchrun_sgemm_target(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha, const double *a,
                 int lda, const double *b, int ldb, double beta, double *c, int ldc) {
    __atomic_add_fetch(&batchrun_gemm_calls, 1, __ATOMIC_RELAXED);
    batchrun_dgemm_target(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void cblas_cgemm(int order, int ta, int tb, int m, int n, int k, const void *alpha,
                 const void *a, int lda, const void *b, int ldb, const void *beta, void *c,
                 int ldc) {
    __atomic_add_fetch(&batchrun_gemm_calls, 1, __ATOMIC_RELAXED);
    batchrun_cgemm_target(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* A module object so that the file is an ordinary, importable extension. */
static struct PyModuleDef shim_module = {PyModuleDef_HEAD_INIT, "_blasshim",
                                         "cblas forwarding shim (load with ctypes)", -1, NULL};

PyMODINIT_FUNC PyInit__blasshim(void) { return PyModule_Create(&shim_module); }
