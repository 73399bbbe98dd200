//go:build !race

package transfer

import "net"

// sendSegment writes b to c straight from its memory; see tcprace.go for
// what race builds do instead.
func sendSegment(c net.Conn, b []byte) (int, error) { return c.Write(b) }
