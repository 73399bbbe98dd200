// Package cuda binds the few parts of the CUDA driver API that mooncake-fs
// needs: devices, primary contexts, streams, host-memory registration
// (pinning), IPC handles, host<->device copies and pointer attributes; and
// lists the machine's GPUs through NVML. It is a leaf: it imports nothing
// of ours. It and rdma/ (the libibverbs binding) are the only packages that
// may use cgo.
//
// # Loading
//
// Nothing CUDA is needed to build. The first call of any function (or
// Init) dlopens libcuda.so.1 (the name the dynamic loader resolves, then
// the driver folders container runtimes mount, such as
// /usr/local/nvidia/lib64; or only the path in $MOONCAKE_LIBCUDA, see
// LibraryEnv), resolves each entry point with dlsym under the name the
// current ABI exports (cuMemAlloc_v2, cuMemcpyHtoDAsync_v2,
// cuIpcOpenMemHandle_v2, ...), and calls cuInit(0). The outcome is kept
// for the life of the process: Init is idempotent and Available reports
// it. The driver is never unloaded.
//
// Built without cgo (CGO_ENABLED=0), the package is a stub with the same
// API in which every entry point returns ErrUnavailable. With cgo but no
// driver (CI, a machine without a GPU) the same holds, and the error
// carries the loader's message:
//
//	cuda: CUDA unavailable: dlopen libcuda.so.1: cannot open shared object file: No such file or directory
//
// Callers check Available (or the ErrUnavailable of their first call)
// once, run without GPU support when it is false, and never need build
// tags of their own. Nothing here panics on a missing driver.
//
// Discover lists GPUs through NVML (github.com/NVIDIA/go-nvml, which
// dlopens libnvidia-ml.so.1 itself) and ties each to its CUDA ordinal by
// UUID; NVML sees every GPU of the machine, CUDA only those in
// CUDA_VISIBLE_DEVICES. Without NVML, Discover returns ErrUnavailable.
//
// # Use
//
//	c, err := cuda.Retain(0) // device 0's primary context
//	if errors.Is(err, cuda.ErrUnavailable) { ... run without GPU copies ... }
//	defer c.Release()
//	if err := c.HostRegister(seg, cuda.HostRegisterPortable); err != nil { ... copies run at pageable speed ... }
//	defer c.HostUnregister(seg)
//	s, _ := c.NewStream()
//	defer s.Close()
//	dev, _ := c.IpcOpen(handle) // another process's cudaMalloc
//	defer c.IpcClose(dev)
//	_ = cuda.CopyDtoHAsync(seg[off:off+n], dev+cuda.DevicePtr(devOff), s)
//	err = s.Sync()
//
// # Contexts and threads
//
// A Context is a reference on a device's primary context, the one the CUDA
// runtime (PyTorch, CuPy) uses, so allocations and IPC mappings are shared
// with such code in the same process. The driver keeps a "current context"
// per OS thread, and goroutines move between threads; so every method
// makes its context current on the calling thread for the one C call it
// makes and restores what was current before, inside that C call. No
// caller needs runtime.LockOSThread, and a context never leaks to another
// goroutine. MakeCurrent exists only for code that calls the driver by
// other means on a thread it has locked with runtime.LockOSThread.
//
// Contexts and Streams are safe for concurrent use, except that Release
// and Close must not race with other calls on the same value. Release
// after closing the context's streams, freeing its allocations, closing
// its IPC mappings and unregistering its host memory: when the last
// reference goes, the driver destroys all of them with the context.
//
// # Memory
//
// HostRegister page-locks host memory for DMA. That memory must come from
// mmap (pinned.Region, a client's memfd mapped into the daemon), never the
// Go heap or a goroutine stack: the driver holds on to the address after
// the call, which the Go runtime's memory does not allow. Register each
// mapping once and whole (overlapping registrations fail with
// ResultHostMemoryAlreadyRegistered), with HostRegisterPortable so every
// device's context sees it pinned, and unregister it before unmapping.
//
// The async copies read or write host memory after they return: it must
// be registered and stay mapped and untouched until Stream.Sync, which
// keeps its thread polling the GPU until they are done (the primary
// context's default scheduling); Stream.SyncAfter sleeps first, for a
// caller that knows about how long the copies take. From
// unregistered memory the driver copies synchronously through its own
// staging buffers, at 7-19 GB/s instead of the ~55 GB/s a pinned copy
// reaches on PCIe Gen5. The synchronous copies (Context.CopyHtoD, CopyDtoH)
// accept any memory, Go slices included.
//
// Device addresses are DevicePtr values in the process's unified address
// space; an offset inside an allocation is an addition, and the driver
// checks the bounds. IpcGetHandle exports the allocation at a base
// address; IpcOpen maps one exported by another process (the driver
// refuses this process's own handles); IpcClose unmaps it. PointerIsDevice
// tells device memory from host memory, to refuse device pointers given to
// host-memory paths.
//
// # Errors
//
// Errors wrap the sentinels in errors.go: ErrUnavailable (no cgo, no
// driver, no device), ErrInvalid (refused before the driver: nil values,
// bad ordinal, empty buffer), ErrClosed (released context, closed stream),
// ErrNVML. A failed driver call is a *Result (errors.As) with the entry
// point, the CUresult code and the driver's name and text for it,
// wrapped with the operation and sizes:
//
//	cuda: alloc 67108864 B on device 0: cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory
//
// It matches ErrDriver, and ErrOutOfMemory for that code. This package
// never logs.
package cuda
