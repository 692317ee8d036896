// The Python module ripplekv_ext._C. Importing it runs the static TORCH_LIBRARY registrations of
// every object file in the library; the module itself only reports how the library was built, so
// Python can refuse a library that does not match the running torch before any op is called.
// (Kept apart from the op sources so the CMake build for C++ users needs no Python.)
#include <Python.h>
#include <torch/version.h>

#ifndef RIPPLEKV_CUDA_VERSION
#define RIPPLEKV_CUDA_VERSION 0  // built without CUDA
#endif

namespace {

PyObject* build_info(PyObject*, PyObject*) {
  // cuda_version is major * 1000 + minor * 10 (13000 for 13.0), 0 for a CPU-only build.
  return Py_BuildValue("{s:i,s:(iii)}", "cuda_version", RIPPLEKV_CUDA_VERSION, "torch_version",
                       TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "How this library was built."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "ripplekv_ext compiled ops", -1, methods};

}  // namespace

extern "C" PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
