// Package rdma is the verbs layer of the RDMA transport: devices, memory
// registration, reliable-connected queue pairs and one-sided RDMA WRITE
// and READ with completion polling, behind one Go interface (Provider,
// Device, MR, QP) with two implementations:
//
//   - Verbs (verbs.go): libibverbs, dlopened at run time as cuda/ loads
//     libcuda, so one binary runs on machines with and without RDMA. The
//     C structs it touches are declared in mc_verbs.h, not taken from
//     rdma-core's headers; a test compares their layout with the
//     installed <infiniband/verbs.h> (libibverbs-dev) where it exists.
//     Where the library, a device or an active port is missing, Open
//     fails with ErrUnavailable and a reason for status.
//   - rdmafake (subpackage): a software NIC for tests, faithful where it
//     matters: it checks lkeys, rkeys, bounds and access flags of every
//     work request, runs each QP's requests in order and different QPs'
//     out of order, moves a QP that fails to the error state and flushes
//     what was queued behind, and injects faults. Its "wire" is a Unix
//     socket per device, so two daemons on one machine reach each other.
//
// The package knows memory and queues; it never sees segments, keys or
// peers (transfer/ does). It and cuda/ are the only packages with cgo.
package rdma
