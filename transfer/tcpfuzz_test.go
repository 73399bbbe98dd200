package transfer

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

func frame(h header) []byte {
	b := make([]byte, headerSize)
	putHeader(b, h)
	return b
}

// FuzzTCPFrame: decodeHeader never panics, fails only with ErrProtocol, and
// what it accepts re-encodes to the same bytes.
func FuzzTCPFrame(f *testing.F) {
	f.Add(frame(header{op: opRead, id: 1, seg: 2, off: 3, len: 4}))
	f.Add(frame(header{op: opWrite, id: 1<<64 - 1, seg: 1<<32 - 1, status: 7, off: 1<<64 - 1, len: maxFrameLen}))
	f.Add(frame(header{op: opChallenge, len: authLen}))
	f.Add([]byte{})
	f.Add(bytes.Repeat([]byte{0xff}, headerSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeHeader(b)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", err)
			}
			return
		}
		if h.len > maxFrameLen || h.op < opChallenge || h.op > opLastFrame {
			t.Fatalf("accepted %+v", h)
		}
		if got := frame(h); !bytes.Equal(got, b[:headerSize]) {
			t.Fatalf("re-encoded %x, decoded from %x", got, b[:headerSize])
		}
	})
}

// FuzzTCPServerConn feeds arbitrary bytes to a server connection after a
// correct handshake. The server must not panic, must end the connection
// when the bytes run out, and must leave segment memory unchanged outside
// the extents of WRITE requests it could serve (a write cut short may
// change its extent partly).
func FuzzTCPServerConn(f *testing.F) {
	f.Add(append(frame(header{op: opWrite, id: 1, seg: 0, off: 10, len: 4}), 1, 2, 3, 4))
	f.Add(append(frame(header{op: opWrite, seg: 1, off: 4090, len: 10}), make([]byte, 10)...))
	f.Add(frame(header{op: opRead, seg: 0, off: 100, len: 200}))
	f.Add(append(frame(header{op: opRead, seg: 5, len: 1}), frame(header{op: opWrite, seg: 1, off: 1, len: 2})...))
	f.Add(append(frame(header{op: opWrite, seg: 0, off: 4000, len: 50}), 9, 9, 9))
	f.Add(frame(header{op: opProof, len: 64}))
	ctl := []byte(`{"op":"reserve","bytes":4096,"ttl_ms":100}`)
	f.Add(append(frame(header{op: opControl, id: 3, len: uint64(len(ctl))}), ctl...))
	f.Add(append(frame(header{op: opControl, id: 4, len: 5}), []byte(`{"op"`)...))
	rb := make([]byte, readBodyLen)
	putReadBody(rb, 10, bodyCheck{body: segment.Extent{Segment: 0, Len: 4096}, version: 3})
	f.Add(append(frame(header{op: opReadBody, id: 5, seg: 0, off: 8, len: readBodyLen}), rb...))
	f.Fuzz(func(t *testing.T, data []byte) {
		const segSize = 4096
		tab := segment.NewTable()
		var orig [][]byte
		for id := range 2 {
			mem := bytes.Repeat([]byte{byte(0x10 + id)}, segSize)
			orig = append(orig, bytes.Clone(mem))
			if err := tab.Add(segment.NewSegment(segment.ID(id), mem)); err != nil {
				t.Fatal(err)
			}
		}
		srv, err := NewTCPServer(TCPServerOptions{Local: tab, Token: testToken})
		if err != nil {
			t.Fatal(err)
		}
		client, server := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer server.Close()
			srv.serveConn(server)
		}()
		if _, err := clientHandshake(client, testToken); err != nil {
			t.Fatal(err)
		}
		drained := make(chan struct{})
		go func() { io.Copy(io.Discard, client); close(drained) }()
		client.Write(data) // fails early if the server hangs up
		client.Close()
		<-done
		<-drained

		// Model: the extents the server could have written.
		mayChange := [2][segSize]bool{}
		for rest := data; len(rest) >= headerSize; {
			h, err := decodeHeader(rest)
			if err != nil || h.op < opRead || h.op > opLastFrame {
				break
			}
			rest = rest[headerSize:]
			if h.op == opControl || h.op == opReadBody {
				if h.len > maxControlLen {
					break
				}
				rest = rest[min(uint64(len(rest)), h.len):]
				continue
			}
			if h.op != opWrite {
				continue
			}
			if _, err := tab.Bytes(h.extent()); err == nil {
				for i := h.off; i < h.off+h.len; i++ {
					mayChange[h.seg][i] = true
				}
			}
			rest = rest[min(uint64(len(rest)), h.len):]
		}
		for id := range 2 {
			s, _ := tab.Get(segment.ID(id))
			for i := range segSize {
				if !mayChange[id][i] && s.Mem[i] != orig[id][i] {
					t.Fatalf("seg%d byte %d changed outside any valid write", id, i)
				}
			}
		}
	})
}
