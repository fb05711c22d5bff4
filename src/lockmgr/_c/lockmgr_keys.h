/* lockmgr._core's key hashing and the key comparison a section may make without Python
   code: plain reads of immutable objects. */
#ifndef LOCKMGR_KEYS_H
#define LOCKMGR_KEYS_H

#include <Python.h>
#include <string.h>

/* hash(key), reading a str's cached hash without a call (the common key). */
static inline Py_hash_t lockmgr_hash(PyObject *key) {
    Py_hash_t cached;
    if (PyUnicode_CheckExact(key)) {
#if PY_VERSION_HEX >= 0x030D0000
        cached = _Py_atomic_load_ssize_relaxed(&((PyASCIIObject *)key)->hash);
#else
        cached = ((PyASCIIObject *)key)->hash;
#endif
        if (cached != -1) return cached;
    }
    return PyObject_Hash(key);
}

/* Key equality without Python code: 1 equal, 0 unequal, -1 unknown (a type whose
   comparison is Python code, an int too big for a long long, nesting too deep).
   Exact str, bytes, int and tuples of them are immutable and compare by plain reads. */
static int lockmgr_exact(PyTypeObject *t) {
    return t == &PyUnicode_Type || t == &PyBytes_Type || t == &PyLong_Type
        || t == &PyTuple_Type;
}
static int lockmgr_key_equal_at(PyObject *a, PyObject *b, int depth) {
    PyTypeObject *type = Py_TYPE(a);
    Py_ssize_t i, n;
    int overflow_a, overflow_b, item, unknown = 0;
    long long value_a, value_b;
    if (a == b) return 1;
    if (type != Py_TYPE(b)) return lockmgr_exact(type) && lockmgr_exact(Py_TYPE(b)) ? 0 : -1;
    if (type == &PyUnicode_Type) {
#if PY_VERSION_HEX < 0x030C0000
        if (!PyUnicode_IS_READY(a) || !PyUnicode_IS_READY(b)) return -1;
#endif
        n = PyUnicode_GET_LENGTH(a);
        if (n != PyUnicode_GET_LENGTH(b) || PyUnicode_KIND(a) != PyUnicode_KIND(b)) return 0;
        return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * PyUnicode_KIND(a)) == 0;
    }
    if (type == &PyBytes_Type) {
        n = PyBytes_GET_SIZE(a);
        return n == PyBytes_GET_SIZE(b)
            && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
    }
    if (type == &PyLong_Type) {  /* never fails for an exact int: overflow is reported */
        value_a = PyLong_AsLongLongAndOverflow(a, &overflow_a);
        value_b = PyLong_AsLongLongAndOverflow(b, &overflow_b);
        if (overflow_a || overflow_b) return -1;
        return value_a == value_b;
    }
    if (type == &PyTuple_Type && depth < 16) {
        n = PyTuple_GET_SIZE(a);
        if (n != PyTuple_GET_SIZE(b)) return 0;
        for (i = 0; i < n; i++) {
            item = lockmgr_key_equal_at(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i), depth + 1);
            if (item == 0) return unknown ? -1 : 0;  /* Python compares in order */
            if (item < 0) unknown = 1;
        }
        return unknown ? -1 : 1;
    }
    return -1;
}
#define lockmgr_key_equal(a, b) lockmgr_key_equal_at((a), (b), 0)

#endif  /* LOCKMGR_KEYS_H */
