// Package transfer moves bytes between buffers and segment extents.
//
// Every data movement in the daemon is a Request: copy between a Buffer
// (memory of a caller, of a registered shared buffer, of another process,
// of a GPU) and an Extent of a segment, on this node or another.
// Engine.Submit runs a batch and picks a strategy per request: memcpy,
// process_vm_readv/writev or a CUDA copy for this node's extents, the
// Transport for other nodes' (remote.go; process and GPU memory pass
// through 4 MiB bounce buffers there, several pieces in flight at once).
//
// Large batches are split into chunks and copied by a pool of workers, so a
// single big put uses every core; small requests are copied inline on the
// caller's goroutine, which is cheaper than a hand-off. Process memory is
// the exception: its chunks are copied by the caller's goroutine and a
// bounded number of helpers of its own, never by the shared workers, as
// its pages may fault on files of the mount itself (processvm.go).
//
// GPU copies are queued on a pooled stream per context and flight, and
// waited for once (gpu.go). A wait of megabytes sleeps through most of
// the time its bytes take at the best rate the context's copies were seen
// to move at (gpuPace), then polls: the driver's own wait polls for all
// of it, a CPU per flight, and its sleeping wait wakes tens of
// microseconds late.
//
// Every strategy counts bytes and copies (one copy = one pass over the
// bytes), so "one copy" is a measured claim: see Stats and the Prometheus
// metrics mooncake_transfer_*.
//
// Remote segments are reached through a Transport (transport.go): the
// TCP transport, one-sided reads and writes of extents served by the
// owning daemon's TCPServer straight from and into its segment memory,
// after a challenge-response proof of the cluster token, plus control
// calls that reserve space for a writer, hold a replaced body for a reader
// and wait for a node's index (control.go); frames are fuzzed. Where
// both ends have an RDMA device, an RDMA path (rdma.go, over package
// rdma) moves the bytes instead with one-sided READs and WRITEs: straight
// from and to registered memory (path rdma-direct, no local copy), other
// memory through a registered bounce pool (rdma-staged, one copy); TCP
// still carries the control calls, the endpoint exchange among them.
//
// The package holds no lock while copying. It never sees keys or objects.
package transfer
