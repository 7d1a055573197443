/*
 * The low-rank decode's hot loop, fused: rows of P Qᵀ as the ordered sum of its rank-1 terms.
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
 * Optional at install (setup.py): where it cannot be compiled, OrderedProduct runs the torch form.
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

static PyMethodDef methods[] = {
    {"ordered_rows", py_ordered_rows, METH_VARARGS, "Rows of P Qᵀ as the ordered sum of rank-1 terms (see lowrank.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", "Fused low-rank decode (see lowrank.py).", -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
