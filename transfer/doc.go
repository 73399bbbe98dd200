// Package transfer moves bytes between buffers and segment extents.
//
// Every data movement in the daemon is a Request: copy between a Buffer
// (memory of a caller, of a registered shared buffer, later of a GPU) and an
// Extent of a segment. Engine.Submit runs a batch and picks a strategy per
// request; today the only strategy is local memcpy (the extent is in this
// daemon's segments and the buffer is host memory). CUDA copies and remote
// transports join behind the same Submit.
//
// Large batches are split into chunks and copied by a pool of workers, so a
// single big put uses every core; small requests are copied inline on the
// caller's goroutine, which is cheaper than a hand-off.
//
// Every strategy counts bytes and copies (one copy = one pass over the
// bytes), so "one copy" is a measured claim: see Stats and the Prometheus
// metrics mooncake_transfer_*.
//
// Remote segments are reached through a Transport (transport.go): today
// the TCP transport, one-sided reads and writes of extents served by the
// owning daemon's TCPServer straight from and into its segment memory,
// after a challenge-response proof of the cluster token; frames are fuzzed.
// It is not yet wired into Submit (the cluster issue does that).
//
// The package holds no lock while copying. It never sees keys or objects.
package transfer
