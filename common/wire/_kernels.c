/*
 * The exchange's two hot loops, fused, with the bits of their torch forms: the low-rank decode (rows of
 * P Qᵀ as the ordered sum of its rank-1 terms) and the round update (a block's weighted mean of the
 * contributions and the outer Nesterov step, `mean_step` below).
 *
 * `common/wire/lowrank.py` (OrderedProduct) defines the rule every shard and cluster decodes by: element
 * (i, j) is p[i,0]·q[0,j], then + p[i,1]·q[1,j], then + …, each product and each addition one rounded
 * fp32 operation, in that order. torch runs it as 2r − 1 separate passes over each block; this does the
 * same operations with 32 columns' partial sums in vector registers, and without the GIL.
 *
 * The bits are the rule's because: every operation is a plain IEEE fp32 multiply or add (built with
 * -ffp-contract=off and without -ffast-math, so no fused multiply-add and no reassociation); the loops
 * are vectorised across j only, so each lane runs exactly the scalar sequence of its element; the
 * subtraction of the `subtract` mode is one more rounded operation, as `target − product` is in torch.
 * tests/test_exchange_kernels.py compares it with the torch form bit for bit.
 *
 * Optional at install (setup.py): where it cannot be compiled, OrderedProduct and OuterNesterov run the
 * torch forms.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define LANES 32 /* columns summed at once: their partial sums stay in vector registers across the rank's terms */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

MULTIVERSION
static void ordered_rows(const float *p, const float *q, Py_ssize_t rank, Py_ssize_t cols, Py_ssize_t start,
                         Py_ssize_t stop, float *out, int subtract) {
    for (Py_ssize_t i = start; i < stop; i++) {
        const float *pi = p + i * rank;
        float *o = out + (i - start) * cols;
        Py_ssize_t j = 0;
        for (; j + LANES <= cols; j += LANES) {
            float acc[LANES];
            for (int t = 0; t < LANES; t++) acc[t] = pi[0] * q[j + t];
            for (Py_ssize_t k = 1; k < rank; k++) {
                const float pk = pi[k];
                const float *qk = q + k * cols + j;
                for (int t = 0; t < LANES; t++) acc[t] = acc[t] + pk * qk[t];
            }
            if (subtract) {
                for (int t = 0; t < LANES; t++) o[j + t] = o[j + t] - acc[t];
            } else {
                for (int t = 0; t < LANES; t++) o[j + t] = acc[t];
            }
        }
        for (; j < cols; j++) { /* the last columns, one at a time: the same operations in the same order */
            float acc = pi[0] * q[j];
            for (Py_ssize_t k = 1; k < rank; k++) acc = acc + pi[k] * q[k * cols + j];
            o[j] = subtract ? o[j] - acc : acc;
        }
    }
}

static int float_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != 4 || (view->format && strcmp(view->format, "f") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous float32 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ordered_rows(p, q, rank, cols, start, stop, out, subtract): p is rows × rank (row-major), q is rank ×
 * cols, out is (stop − start) × cols; writes (or, with subtract, subtracts) rows [start, stop). */
static PyObject *py_ordered_rows(PyObject *self, PyObject *args) {
    PyObject *p_obj, *q_obj, *out_obj;
    Py_ssize_t rank, cols, start, stop;
    int subtract;
    if (!PyArg_ParseTuple(args, "OOnnnnOp", &p_obj, &q_obj, &rank, &cols, &start, &stop, &out_obj, &subtract)) return NULL;
    Py_buffer p, q, out;
    if (float_buffer(p_obj, &p, 0, "p") < 0) return NULL;
    if (float_buffer(q_obj, &q, 0, "q") < 0) {
        PyBuffer_Release(&p);
        return NULL;
    }
    if (float_buffer(out_obj, &out, 1, "out") < 0) {
        PyBuffer_Release(&p);
        PyBuffer_Release(&q);
        return NULL;
    }
    const char *error = NULL;
    if (rank < 1 || cols < 0 || start < 0 || stop < start) error = "bad rank, cols or row range";
    else if (p.len / 4 < stop * rank) error = "p holds fewer rows than asked for";
    else if (q.len / 4 < rank * cols) error = "q is smaller than rank × cols";
    else if (out.len / 4 < (stop - start) * cols) error = "out is smaller than the rows asked for";
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS ordered_rows((const float *)p.buf, (const float *)q.buf, rank, cols, start, stop,
                                            (float *)out.buf, subtract);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&p);
    PyBuffer_Release(&q);
    PyBuffer_Release(&out);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The round's weighted mean and outer Nesterov step on one block, with the operations and roundings of
 * `aggregation.apply_round` and `OuterNesterov.step_by_block` in torch (a float scalar enters each
 * operation rounded to fp32, as torch's CPU kernels take it):
 *   g  = ((s₀·w₀ + s₁·w₁) + …) / total
 *   v' = first ? g : v·μ + g;   u = (v'·μ + g)·lr;   θ' = θ − u
 * `v_in` may be v_out and `theta_in` theta_out (in place): every element is read before it is written. */
#define STEP_TILE 256 /* elements per pass: the tile's mean stays in L1 between the passes */

MULTIVERSION
static void mean_step(const float **src, const float *w, Py_ssize_t m, float total, const float *v_in, float *v_out,
                      const float *theta_in, float *theta_out, Py_ssize_t n, float lr, float mu) {
    float g[STEP_TILE];
    for (Py_ssize_t j0 = 0; j0 < n; j0 += STEP_TILE) {
        Py_ssize_t len = n - j0 < STEP_TILE ? n - j0 : STEP_TILE;
        const float *s0 = src[0] + j0;
        const float w0 = w[0];
        for (Py_ssize_t t = 0; t < len; t++) g[t] = s0[t] * w0;
        for (Py_ssize_t c = 1; c < m; c++) {
            const float *sc = src[c] + j0;
            const float wc = w[c];
            for (Py_ssize_t t = 0; t < len; t++) g[t] = g[t] + sc[t] * wc;
        }
        for (Py_ssize_t t = 0; t < len; t++) g[t] = g[t] / total;
        float *vo = v_out + j0, *to = theta_out + j0;
        const float *ti = theta_in + j0;
        if (v_in) {
            const float *vi = v_in + j0;
            for (Py_ssize_t t = 0; t < len; t++) {
                float v = vi[t] * mu + g[t];
                vo[t] = v;
                to[t] = ti[t] - (v * mu + g[t]) * lr;
            }
        } else {
            for (Py_ssize_t t = 0; t < len; t++) {
                vo[t] = g[t];
                to[t] = ti[t] - (g[t] * mu + g[t]) * lr;
            }
        }
    }
}

#define MAX_SOURCES 256

/* mean_step(sources, weights, total, v_in or None, v_out, theta_in, theta_out, lr, mu): every buffer a
 * contiguous float32 one of the same length. */
static PyObject *py_mean_step(PyObject *self, PyObject *args) {
    PyObject *sources, *weights, *v_in_obj, *v_out_obj, *theta_in_obj, *theta_out_obj;
    double total, lr, mu;
    if (!PyArg_ParseTuple(args, "OOdOOOOdd", &sources, &weights, &total, &v_in_obj, &v_out_obj, &theta_in_obj,
                          &theta_out_obj, &lr, &mu))
        return NULL;
    if (!PyTuple_Check(sources) || !PyTuple_Check(weights) || PyTuple_GET_SIZE(sources) != PyTuple_GET_SIZE(weights)) {
        PyErr_SetString(PyExc_TypeError, "sources and weights must be tuples of one length");
        return NULL;
    }
    Py_ssize_t m = PyTuple_GET_SIZE(sources);
    if (m < 1 || m > MAX_SOURCES) {
        PyErr_SetString(PyExc_ValueError, "between 1 and 256 sources");
        return NULL;
    }
    Py_buffer views[MAX_SOURCES + 4];
    int held = 0;
    const float *src[MAX_SOURCES];
    float w[MAX_SOURCES];
    const char *error = NULL;
    Py_ssize_t n = -1;
    PyObject *outputs[4] = {v_in_obj, v_out_obj, theta_in_obj, theta_out_obj};
    float *bufs[4] = {NULL, NULL, NULL, NULL};
    for (Py_ssize_t c = 0; c < m && error == NULL; c++) {
        if (float_buffer(PyTuple_GET_ITEM(sources, c), &views[held], 0, "a source") < 0) goto fail;
        src[c] = (const float *)views[held].buf;
        if (n < 0) n = views[held].len / 4;
        else if (views[held].len / 4 != n) error = "sources of different lengths";
        held++;
        w[c] = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(weights, c));
        if (PyErr_Occurred()) goto fail;
    }
    for (int b = 0; b < 4 && error == NULL; b++) {
        if (b == 0 && outputs[b] == Py_None) continue;
        if (float_buffer(outputs[b], &views[held], b == 1 || b == 3, "a state buffer") < 0) goto fail;
        bufs[b] = (float *)views[held].buf;
        if (views[held].len / 4 != n) error = "state buffers and sources of different lengths";
        held++;
    }
    if (error == NULL) {
        Py_BEGIN_ALLOW_THREADS mean_step(src, w, m, (float)total, bufs[0], bufs[1], bufs[2], bufs[3], n, (float)lr, (float)mu);
        Py_END_ALLOW_THREADS
    }
    for (int h = 0; h < held; h++) PyBuffer_Release(&views[h]);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
fail:
    for (int h = 0; h < held; h++) PyBuffer_Release(&views[h]);
    return NULL;
}

static PyMethodDef methods[] = {
    {"ordered_rows", py_ordered_rows, METH_VARARGS, "Rows of P Qᵀ as the ordered sum of rank-1 terms (see lowrank.py)."},
    {"mean_step", py_mean_step, METH_VARARGS, "A block's weighted mean and outer Nesterov step (see aggregation.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused low-rank decode (see lowrank.py).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
