package cuda

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error this package returns wraps one of these, so
// callers test them with errors.Is and never by their text. A failed driver
// call also carries a *Result (errors.As) with the CUresult code.
var (
	// ErrUnavailable: there is no usable CUDA here. The package was built
	// without cgo, libcuda.so.1 could not be loaded or lacks a symbol we
	// need, cuInit failed (no device, driver/library mismatch), or, for
	// Discover, libnvidia-ml.so.1 is missing or NVML would not start. The
	// wrapping error says which, with the loader's own message.
	ErrUnavailable = errors.New("cuda: CUDA unavailable")

	// ErrInvalid: an argument was refused before reaching the driver (nil or
	// zero Context or Stream, device ordinal out of range, empty buffer).
	ErrInvalid = errors.New("cuda: invalid argument")

	// ErrClosed: the Context was released or the Stream closed.
	ErrClosed = errors.New("cuda: released or closed")

	// ErrDriver: a driver call failed; the error chain holds a *Result.
	ErrDriver = errors.New("cuda: driver error")

	// ErrOutOfMemory: the driver answered CUDA_ERROR_OUT_OF_MEMORY (device
	// memory for MemAlloc, locked host memory for HostRegister). Matched by
	// a *Result with that code.
	ErrOutOfMemory = errors.New("cuda: out of memory")

	// ErrNVML: an NVML query failed after NVML had started.
	ErrNVML = errors.New("cuda: nvml error")
)

// CUresult codes that callers may want to test for (with errors.As on
// *Result). The numbers are the driver API's and never change.
const (
	ResultInvalidValue                = 1
	ResultOutOfMemory                 = 2
	ResultNotInitialized              = 3
	ResultNoDevice                    = 100
	ResultInvalidDevice               = 101
	ResultInvalidContext              = 201
	ResultMapFailed                   = 205
	ResultAlreadyMapped               = 208
	ResultInvalidHandle               = 400
	ResultPeerAccessUnsupported       = 217
	ResultHostMemoryAlreadyRegistered = 712
	ResultHostMemoryNotRegistered     = 713
	ResultNotPermitted                = 800
	ResultNotSupported                = 801
	ResultUnknown                     = 999
)

// Result is a failed driver call: the CUDA function, its CUresult code, and
// the driver's own name and description of the code (from cuGetErrorName and
// cuGetErrorString; empty where the driver has none). It matches ErrDriver,
// and ErrOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY. The package always wraps
// it with the operation and sizes, so its own text carries no "cuda:" prefix.
type Result struct {
	Func    string // driver entry point, e.g. "cuMemAlloc_v2"
	Code    int    // CUresult
	Name    string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
	Message string // e.g. "out of memory"
}

func (r *Result) Error() string {
	name := r.Name
	if name == "" {
		name = "CUresult"
	}
	if r.Message == "" {
		return fmt.Sprintf("%s: %s %d", r.Func, name, r.Code)
	}
	return fmt.Sprintf("%s: %s (%d): %s", r.Func, name, r.Code, r.Message)
}

// Is reports whether r matches one of this package's sentinels.
func (r *Result) Is(target error) bool {
	switch target {
	case ErrDriver:
		return true
	case ErrOutOfMemory:
		return r.Code == ResultOutOfMemory
	}
	return false
}
