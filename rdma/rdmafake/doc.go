// Package rdmafake is a software RDMA NIC for tests: an rdma.Provider
// whose devices move bytes between registered memory regions of one or
// several processes of this machine, through a Unix socket per device
// in a shared folder (the "fabric").
//
// It is faithful where the transport could get things wrong:
//
//   - every work request's SGEs are checked against the requester's
//     MRs (lkey, bounds, LOCAL_WRITE for the target of a READ) and its
//     remote address against the responder's MRs (rkey, bounds,
//     REMOTE_WRITE / REMOTE_READ); a stale or missing registration fails
//     the request with the status a NIC would report, never copies;
//   - a responder serves only requests from the QP it was connected to;
//     requests to another QP are dropped, which the requester sees as a
//     retry-exceeded error;
//   - each QP runs its requests in order and completes them
//     asynchronously; different QPs run concurrently (Options.Jitter
//     shuffles them further);
//   - a failed request moves its QP to the error state, and every
//     request queued behind it, or posted later, completes with a flush
//     error;
//   - Inject makes the next requests fail: QP to error, remote access
//     error, or a completion that never comes (the caller's timeout must
//     notice).
//   - dma-buf registrations reach device memory through
//     Options.DeviceMemory (the GPU's, on a GPU host; HostMemory in
//     tests without one), checked as the kernel checks an import;
//     without it they are refused, as by a NIC without peer memory.
//
// The fake NIC copies through sockets; those copies are the NIC's, not
// the transport's, and no transport statistic should count them.
package rdmafake
