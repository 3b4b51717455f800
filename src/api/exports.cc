// libkvxfer.so is kvxfer_core, kvxfer_transport and kvxfer_xfer linked whole; src/libkvxfer.map
// keeps only the kvxfer_* C API visible.  This translation unit exists because a shared library
// target needs at least one source of its own.
#include "kvxfer/kvxfer.h"
