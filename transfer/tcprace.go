//go:build race

package transfer

import "net"

// sendSegment writes b to c. In race builds it sends a copy of b: the
// runtime records write(2)'s read of b after the syscall's release, so a
// later write of the same memory by another server goroutine, ordered only
// by the peer's reply (read on connection X, then write on connection Y),
// is reported as a race although the kernel had finished with b. The copy
// reads b before the send, where the detector can order it. Builds without
// -race send b itself (tcpnorace.go).
func sendSegment(c net.Conn, b []byte) (int, error) {
	return c.Write(append([]byte(nil), b...))
}
