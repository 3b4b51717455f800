// libfabric, loaded on the transport's first use.
//
// libkvxfer.so does not link libfabric.  Loading libfabric loads its
// dependencies, and Debian's libinfinipath installs crash handlers from its
// constructor (crash_signals.h).  Linked, that would happen in every process
// that links kvxfer, whether or not it ever opens a transport.  load() opens
// the library on the first Domain::open instead, and the five functions below
// stand for the libfabric functions of the same names.  Everything else
// libfabric offers is reached through the objects they return (the fi_*
// inline calls of <rdma/fi_*.h>).
#pragma once

#include <rdma/fabric.h>

#include <cstdint>

#include "kvxfer/kvxfer.h"

namespace kvxfer::transport::fabric_lib {

/**
 * Loads libfabric (libfabric.so.1) once per process, in this order:
 *   1. apply_provider_memory_defaults() (ofi.h): its variables into the
 *      environment before libfabric reads its parameters;
 *   2. dlopen by name, else from the directory of the libfabric kvxfer was
 *      built against; then the five functions below at the symbol versions
 *      that the headers kvxfer was built with bind to;
 *   3. restore_crash_signals() (crash_signals.h) against the dispositions
 *      from before the dlopen: a handler libinfinipath or libpsm installed
 *      gives way to what the process had.
 * Thread-safe (std::call_once); later calls return the first call's result
 * and set its error again.
 *
 * Errors: KVXFER_ERR_UNSUPPORTED when the library cannot be opened,
 * KVXFER_ERR_SYSTEM when it lacks one of the functions (the message names it).
 */
kvxfer_result_t load();

/** True once load() has succeeded. */
bool loaded();

// fi_getinfo, fi_freeinfo, fi_dupinfo, fi_fabric.  Each requires a
// successful load() first; before it getinfo and fabric return -FI_ENOSYS,
// dupinfo returns NULL and freeinfo does nothing.  Thread-safety is
// libfabric's.
int getinfo(uint32_t version, const char* node, const char* service, uint64_t flags,
            const fi_info* hints, fi_info** info);
void freeinfo(fi_info* info);
/** fi_dupinfo; dupinfo(nullptr) is fi_allocinfo(). */
fi_info* dupinfo(const fi_info* info);
int fabric(fi_fabric_attr* attr, fid_fabric** fabric, void* context);

/** fi_strerror; before load(), the C library's text for `errnum`. */
const char* strerror(int errnum);

}  // namespace kvxfer::transport::fabric_lib
