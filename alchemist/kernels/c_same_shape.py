"""C code shared by the Ops whose float32 output has their input's shape (GeluTable, RmsNormGgml)."""

from __future__ import annotations


def same_shape_c_code(x: str, y: str, fail: str, body: str) -> str:
    """C code that makes `xc_` a C-contiguous view of input `x`, (re)allocates output `y` as a float32 array of
    its shape, runs `body` (which reads xc_ and writes y), then releases xc_."""
    return f"""
        {{
            PyArrayObject *xc_ = PyArray_GETCONTIGUOUS({x});
            if (!xc_) {{ {fail} }}
            if (!{y} || PyArray_NDIM({y}) != PyArray_NDIM(xc_) || !PyArray_CompareLists(PyArray_DIMS({y}), PyArray_DIMS(xc_), PyArray_NDIM(xc_))
                || !PyArray_IS_C_CONTIGUOUS({y}) || PyArray_TYPE({y}) != NPY_FLOAT32) {{
                Py_XDECREF({y});
                {y} = (PyArrayObject *)PyArray_EMPTY(PyArray_NDIM(xc_), PyArray_DIMS(xc_), NPY_FLOAT32, 0);
                if (!{y}) {{ Py_DECREF(xc_); {fail} }}
            }}
            {body}
            Py_DECREF(xc_);
        }}
        """
