package transfer

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

// BenchmarkTCP measures remote read and write of 64 MiB over loopback next
// to their ceiling: a plain TCP stream of the same bytes between two
// endpoints of the same kind (an 8-byte request, then 64 MiB from one
// []byte into another), on 1 connection and on as many as the transport
// uses. Run with -bench TCP -benchtime 20x.
func BenchmarkTCP(b *testing.B) {
	const size = 64 << 20
	conns := DefaultTCPOptions().ConnsPerPeer
	for _, nc := range []int{1, conns} {
		b.Run(fmt.Sprintf("path=tcp-stream/conns=%d/size=64MiB", nc), func(b *testing.B) {
			benchStream(b, size, nc)
		})
	}
	n := newTCPNode(b, testToken, size, TCPServerOptions{})
	tr := newTCPClient(b, testToken, map[string]string{"n": n.addr}, TCPOptions{})
	buf := make([]byte, size)
	e := segment.Extent{Segment: 1, Len: size}
	for _, op := range []frameOp{opRead, opWrite} {
		b.Run(fmt.Sprintf("path=transport/op=%v/conns=%d/size=64MiB", op, conns), func(b *testing.B) {
			ctx := context.Background()
			b.SetBytes(size)
			b.ResetTimer()
			for range b.N {
				var err error
				if op == opRead {
					err = tr.ReadAt(ctx, "n", 0, e, buf)
				} else {
					err = tr.WriteAt(ctx, "n", 0, 0, e, buf)
				}
				if err != nil {
					b.Fatal(err)
				}
			}
			reportGBps(b, size)
		})
	}
}

func reportGBps(b *testing.B, size int) {
	b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
}

// benchStream is the ceiling: each op asks nc connections for size/nc
// bytes each and reads them in parallel into one buffer.
func benchStream(b *testing.B, size, nc int) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	src := make([]byte, size)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var req [8]byte
				for {
					if _, err := io.ReadFull(c, req[:]); err != nil {
						return
					}
					if _, err := c.Write(src[:binary.LittleEndian.Uint64(req[:])]); err != nil {
						return
					}
				}
			}()
		}
	}()
	cs := make([]net.Conn, nc)
	for i := range cs {
		if cs[i], err = net.Dial("tcp", ln.Addr().String()); err != nil {
			b.Fatal(err)
		}
		defer cs[i].Close()
	}
	dst := make([]byte, size)
	part := size / nc
	b.SetBytes(int64(size))
	b.ResetTimer()
	for range b.N {
		var wg sync.WaitGroup
		for i, c := range cs {
			wg.Go(func() {
				var req [8]byte
				binary.LittleEndian.PutUint64(req[:], uint64(part))
				if _, err := c.Write(req[:]); err != nil {
					b.Error(err)
					return
				}
				if _, err := io.ReadFull(c, dst[i*part:(i+1)*part]); err != nil {
					b.Error(err)
				}
			})
		}
		wg.Wait()
	}
	reportGBps(b, size)
}
