package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

var testToken = []byte("0123456789abcdef0123456789abcdef")

// hang bounds "fails instead of hanging"; it is no performance claim.
const hang = 30 * time.Second

type tcpNode struct {
	tab  *segment.Table
	srv  *TCPServer
	addr string
}

// newTCPNode serves two random-filled segments (IDs 0 and 1) of segSize
// bytes on a loopback port.
func newTCPNode(t testing.TB, token []byte, segSize int, o TCPServerOptions) *tcpNode {
	t.Helper()
	tab := segment.NewTable()
	rng := rand.New(rand.NewSource(int64(segSize)))
	for id := range 2 {
		mem := make([]byte, segSize)
		rng.Read(mem)
		if err := tab.Add(segment.NewSegment(segment.ID(id), mem)); err != nil {
			t.Fatal(err)
		}
	}
	if o.Local == nil {
		o.Local = tab
	}
	o.Token = token
	if o.Log == nil {
		o.Log = t.Logf
	}
	srv, err := NewTCPServer(o)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		srv.Close()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &tcpNode{tab: tab, srv: srv, addr: ln.Addr().String()}
}

func (n *tcpNode) mem(t testing.TB, e segment.Extent) []byte {
	t.Helper()
	b, err := n.tab.Bytes(e)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func newTCPClient(t testing.TB, token []byte, nodes map[string]string, o TCPOptions) *TCPTransport {
	t.Helper()
	o.Token = token
	o.Resolve = func(node string) (string, error) {
		if a, ok := nodes[node]; ok {
			return a, nil
		}
		return "", fmt.Errorf("no node %q", node)
	}
	tr, err := NewTCPTransport(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

func TestTCPOptionsValidate(t *testing.T) {
	err := TCPOptions{ConnsPerPeer: -1, Timeout: -1, ChunkBytes: 1}.Validate()
	if err == nil {
		t.Fatal("bad options accepted")
	}
	for _, f := range []string{"Token", "Resolve", "ConnsPerPeer", "Timeout", "ChunkBytes"} {
		if !bytes.Contains([]byte(err.Error()), []byte(f)) {
			t.Errorf("error %q does not name %s", err, f)
		}
	}
	if err := (TCPServerOptions{AuthTimeout: -1}).Validate(); err == nil {
		t.Fatal("bad server options accepted")
	}
}

func TestTCPRoundTrip(t *testing.T) {
	const segSize = 24 << 20
	a := newTCPNode(t, testToken, segSize, TCPServerOptions{})
	b := newTCPNode(t, testToken, segSize, TCPServerOptions{})
	nodes := map[string]*tcpNode{"a": a, "b": b}
	for _, chunk := range []uint64{0, 1 << 20} {
		t.Run(fmt.Sprintf("chunk=%d", chunk), func(t *testing.T) {
			tr := newTCPClient(t, testToken, map[string]string{"a": a.addr, "b": b.addr},
				TCPOptions{ChunkBytes: chunk})
			rng := rand.New(rand.NewSource(int64(chunk)))
			ctx := context.Background()
			for _, size := range []int{0, 1, 7, 4095, 4096, 65537, 1<<20 + 3, 5<<20 + 11, 9 << 20} {
				for _, off := range []uint64{0, 1, 12345, segSize - uint64(size)} {
					for name, n := range nodes {
						e := segment.Extent{Segment: segment.ID(rng.Intn(2)), Off: off, Len: uint64(size)}
						src := make([]byte, size)
						rng.Read(src)
						if err := tr.WriteAt(ctx, name, 0, 0, e, src); err != nil {
							t.Fatalf("write %s %v: %v", name, e, err)
						}
						if !bytes.Equal(n.mem(t, e), src) {
							t.Fatalf("write %s %v: segment memory differs", name, e)
						}
						// Read back what the owner holds, changed under the
						// transport's feet.
						rng.Read(n.mem(t, e))
						dst := make([]byte, size)
						if err := tr.ReadAt(ctx, name, 0, e, dst); err != nil {
							t.Fatalf("read %s %v: %v", name, e, err)
						}
						if !bytes.Equal(dst, n.mem(t, e)) {
							t.Fatalf("read %s %v: wrong bytes", name, e)
						}
					}
				}
			}
			st := tr.Stats()
			if st.BytesRead == 0 || st.BytesRead != st.BytesWritten || st.Dropped != 0 {
				t.Fatalf("stats %+v", st)
			}
			if st.Dials > 2*uint64(DefaultTCPOptions().ConnsPerPeer) {
				t.Fatalf("%d dials for 2 peers: connections not reused", st.Dials)
			}
		})
	}
	if s := a.srv.Stats(); s.BytesRead == 0 || s.BytesWritten == 0 || s.BadRequests != 0 {
		t.Fatalf("server stats %+v", s)
	}
}

func TestTCPConcurrent(t *testing.T) {
	n := newTCPNode(t, testToken, 8<<20, TCPServerOptions{})
	tr := newTCPClient(t, testToken, map[string]string{"n": n.addr}, TCPOptions{ConnsPerPeer: 3, ChunkBytes: 64 << 10})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewSource(int64(g)))
			base := uint64(g) << 20 // each goroutine owns 1 MiB of segment 1
			for range 20 {
				e := segment.Extent{Segment: 1, Off: base + uint64(rng.Intn(1000)), Len: uint64(1 + rng.Intn(300<<10))}
				src := make([]byte, e.Len)
				rng.Read(src)
				if err := tr.WriteAt(context.Background(), "n", 0, 0, e, src); err != nil {
					t.Error(err)
					return
				}
				dst := make([]byte, e.Len)
				if err := tr.ReadAt(context.Background(), "n", 0, e, dst); err != nil {
					t.Error(err)
					return
				}
				if !bytes.Equal(src, dst) {
					t.Errorf("goroutine %d: %v read back differs", g, e)
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestTCPBoundsKeepConnection(t *testing.T) {
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	tr := newTCPClient(t, testToken, map[string]string{"n": n.addr}, TCPOptions{ConnsPerPeer: 1})
	ctx := context.Background()
	before := bytes.Clone(n.mem(t, segment.Extent{Segment: 0, Len: 1 << 20}))
	for _, c := range []struct {
		e    segment.Extent
		want error
	}{
		{segment.Extent{Segment: 9, Off: 0, Len: 10}, segment.ErrUnknownSegment},
		{segment.Extent{Segment: 0, Off: 1 << 20, Len: 1}, segment.ErrBadRange},
		{segment.Extent{Segment: 0, Off: 1<<20 - 5, Len: 10}, segment.ErrBadRange},
		{segment.Extent{Segment: 0, Off: 1<<64 - 5, Len: 10}, segment.ErrBadRange},
		{segment.Extent{Segment: 0, Off: 0, Len: 2 << 20}, segment.ErrBadRange},
	} {
		buf := make([]byte, c.e.Len)
		if err := tr.ReadAt(ctx, "n", 0, c.e, buf); !errors.Is(err, c.want) {
			t.Errorf("read %v: %v, want %v", c.e, err, c.want)
		}
		if err := tr.WriteAt(ctx, "n", 0, 0, c.e, buf); !errors.Is(err, c.want) {
			t.Errorf("write %v: %v, want %v", c.e, err, c.want)
		}
	}
	if err := tr.ReadAt(ctx, "n", 0, segment.Extent{Len: 10}, make([]byte, 3)); !errors.Is(err, ErrBadRequest) {
		t.Errorf("short buffer: %v", err)
	}
	if !bytes.Equal(before, n.mem(t, segment.Extent{Segment: 0, Len: 1 << 20})) {
		t.Fatal("refused writes changed segment memory")
	}
	dst := make([]byte, 100)
	if err := tr.ReadAt(ctx, "n", 0, segment.Extent{Segment: 0, Off: 5, Len: 100}, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, before[5:105]) {
		t.Fatal("read after refused requests: wrong bytes")
	}
	if st := tr.Stats(); st.Dials != 1 || st.Dropped != 0 {
		t.Fatalf("refused requests cost the connection: %+v", st)
	}
	if s := n.srv.Stats(); s.BadRequests != 10 || s.ProtocolErrors != 0 {
		t.Fatalf("server stats %+v", s)
	}
}

func TestTCPWrongToken(t *testing.T) {
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	other := bytes.Repeat([]byte("x"), 32)
	tr := newTCPClient(t, other, map[string]string{"n": n.addr}, TCPOptions{})
	dst := make([]byte, 10)
	err := tr.ReadAt(context.Background(), "n", 0, segment.Extent{Len: 10}, dst)
	if !errors.Is(err, ErrAuth) {
		t.Fatalf("read with another token: %v, want ErrAuth", err)
	}
	if !bytes.Equal(dst, make([]byte, 10)) {
		t.Fatal("bytes came back without authentication")
	}
	if s := n.srv.Stats(); s.AuthFailures != 1 || s.Requests != 0 {
		t.Fatalf("server stats %+v", s)
	}
}

// readChallenge reads the server's challenge from a raw connection.
func readChallenge(t *testing.T, c net.Conn) []byte {
	t.Helper()
	c.SetDeadline(time.Now().Add(hang))
	b := make([]byte, headerSize+authLen)
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatal(err)
	}
	h, err := decodeHeader(b)
	if err != nil || h.op != opChallenge || h.len != authLen {
		t.Fatalf("challenge %+v, %v", h, err)
	}
	return b[headerSize:]
}

// expectDropped asserts that the server closes c without sending a byte.
func expectDropped(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetDeadline(time.Now().Add(hang))
	n, err := io.Copy(io.Discard, c)
	if n != 0 {
		t.Fatalf("unauthenticated peer got %d B", n)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("server did not drop the peer")
	}
}

func TestTCPServerRefusesUnauthenticated(t *testing.T) {
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{AuthTimeout: 200 * time.Millisecond})
	dial := func(t *testing.T) net.Conn {
		c, err := net.Dial("tcp", n.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	t.Run("garbage", func(t *testing.T) {
		c := dial(t)
		readChallenge(t, c)
		c.Write(bytes.Repeat([]byte{0xa5}, headerSize+2*authLen))
		expectDropped(t, c)
	})
	t.Run("bad-proof", func(t *testing.T) {
		c := dial(t)
		ch := readChallenge(t, c)
		msg := make([]byte, headerSize+2*authLen)
		putHeader(msg, header{op: opProof, len: 2 * authLen})
		copy(msg[headerSize:], authMAC([]byte("not the token at all"), ch, msg[headerSize+authLen:]))
		c.Write(msg)
		expectDropped(t, c)
	})
	t.Run("request-before-auth", func(t *testing.T) {
		c := dial(t)
		readChallenge(t, c)
		msg := make([]byte, headerSize)
		putHeader(msg, header{op: opRead, len: 100})
		c.Write(msg)
		expectDropped(t, c)
	})
	t.Run("silent", func(t *testing.T) {
		c := dial(t)
		readChallenge(t, c)
		expectDropped(t, c) // AuthTimeout fires
	})
	if s := n.srv.Stats(); s.AuthFailures != 4 || s.Requests != 0 {
		t.Fatalf("server stats %+v", s)
	}
}

// fakePeer accepts connections and hands each to serve.
func fakePeer(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { defer c.Close(); serve(c) })
		}
	})
	return ln.Addr().String()
}

func TestTCPClientRefusesImpostor(t *testing.T) {
	// A server without the token accepts any proof but cannot answer it.
	addr := fakePeer(t, func(c net.Conn) {
		msg := make([]byte, headerSize+2*authLen)
		putHeader(msg, header{op: opChallenge, len: authLen})
		c.Write(msg[:headerSize+authLen])
		if _, err := io.ReadFull(c, msg); err != nil {
			return
		}
		putHeader(msg, header{op: opAccept, len: authLen})
		c.Write(msg[:headerSize+authLen]) // a MAC of zeros
		io.Copy(io.Discard, c)
	})
	tr := newTCPClient(t, testToken, map[string]string{"n": addr}, TCPOptions{})
	if err := tr.ReadAt(context.Background(), "n", 0, segment.Extent{Len: 1}, make([]byte, 1)); !errors.Is(err, ErrAuth) {
		t.Fatalf("impostor accepted: %v", err)
	}
}

// gate is a Resolver that blocks requests for segment 1 until released.
type gate struct {
	*segment.Table
	entered chan struct{}
	once    sync.Once
	release chan struct{}
}

func newGate() *gate {
	return &gate{entered: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) Bytes(e segment.Extent) ([]byte, error) {
	if e.Segment == 1 {
		g.once.Do(func() { close(g.entered) })
		<-g.release
	}
	return g.Table.Bytes(e)
}

// failsWithin runs f and asserts it returns an error before hang.
func failsWithin(t *testing.T, what string, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatalf("%s succeeded", what)
		}
		t.Logf("%s: %v", what, err)
		return err
	case <-time.After(hang):
		t.Fatalf("%s hangs", what)
	}
	return nil
}

func TestTCPServerClosedMidTransfer(t *testing.T) {
	for _, op := range []frameOp{opRead, opWrite} {
		t.Run(op.String(), func(t *testing.T) {
			g := newGate()
			n := newTCPNode(t, testToken, 64<<20, TCPServerOptions{Local: g})
			g.Table = n.tab
			tr := newTCPClient(t, testToken, map[string]string{"n": n.addr}, TCPOptions{})
			buf := make([]byte, 64<<20)
			e := segment.Extent{Segment: 1, Len: 64 << 20}
			closed := make(chan struct{})
			go func() {
				<-g.entered
				go func() { n.srv.Close(); close(closed) }()
				time.Sleep(50 * time.Millisecond) // let Close shut the connections first
				close(g.release)
			}()
			failsWithin(t, op.String(), func() error {
				if op == opRead {
					return tr.ReadAt(context.Background(), "n", 0, e, buf)
				}
				return tr.WriteAt(context.Background(), "n", 0, 0, e, buf)
			})
			<-closed
		})
	}
}

func TestTCPPeerNeverAnswers(t *testing.T) {
	silent := fakePeer(t, func(c net.Conn) { io.Copy(io.Discard, c) })
	t.Run("handshake/timeout", func(t *testing.T) {
		tr := newTCPClient(t, testToken, map[string]string{"n": silent}, TCPOptions{Timeout: 200 * time.Millisecond})
		err := failsWithin(t, "read", func() error {
			return tr.ReadAt(context.Background(), "n", 0, segment.Extent{Len: 1}, make([]byte, 1))
		})
		if !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err) {
			t.Fatalf("want a deadline error, got %v", err)
		}
	})
	t.Run("handshake/ctx", func(t *testing.T) {
		tr := newTCPClient(t, testToken, map[string]string{"n": silent}, TCPOptions{})
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		failsWithin(t, "write", func() error {
			return tr.WriteAt(ctx, "n", 0, 0, segment.Extent{Len: 1}, make([]byte, 1))
		})
	})
	t.Run("request", func(t *testing.T) {
		g := newGate()
		n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{Local: g})
		g.Table = n.tab
		defer close(g.release)
		tr := newTCPClient(t, testToken, map[string]string{"n": n.addr}, TCPOptions{Timeout: 200 * time.Millisecond})
		failsWithin(t, "read", func() error {
			return tr.ReadAt(context.Background(), "n", 0, segment.Extent{Segment: 1, Len: 10}, make([]byte, 10))
		})
		if st := tr.Stats(); st.Dropped != 1 {
			t.Fatalf("timed-out connection kept: %+v", st)
		}
	})
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// restartingPeer returns a one-connection transport whose node "n" is at
// n's address until the test stores another in addr (the node restarted).
func restartingPeer(t *testing.T, n *tcpNode) (*TCPTransport, *atomic.Value) {
	t.Helper()
	var addr atomic.Value
	addr.Store(n.addr)
	tr, err := NewTCPTransport(TCPOptions{Token: testToken, ConnsPerPeer: 1,
		Resolve: func(string) (string, error) { return addr.Load().(string), nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr, &addr
}

func TestTCPRedial(t *testing.T) {
	n1 := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	n2 := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	tr, addr := restartingPeer(t, n1)
	e := segment.Extent{Segment: 0, Off: 3, Len: 1000}
	dst := make([]byte, e.Len)
	if err := tr.ReadAt(context.Background(), "n", 0, e, dst); err != nil {
		t.Fatal(err)
	}
	n1.srv.Close() // the node restarts elsewhere
	addr.Store(n2.addr)
	// The pooled connection is broken: the call drops it and retries once
	// on a fresh connection, so it succeeds.
	if err := tr.ReadAt(context.Background(), "n", 0, e, dst); err != nil {
		t.Fatalf("no redial: %v", err)
	}
	if !bytes.Equal(dst, n2.mem(t, e)) {
		t.Fatal("wrong bytes after redial")
	}
	if st := tr.Stats(); st.Dials != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestTCPTransportClose(t *testing.T) {
	n := newTCPNode(t, testToken, 1<<20, TCPServerOptions{})
	tr := newTCPClient(t, testToken, map[string]string{"n": n.addr}, TCPOptions{})
	if err := tr.ReadAt(context.Background(), "n", 0, segment.Extent{Len: 1}, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	tr.Close()
	if err := tr.ReadAt(context.Background(), "n", 0, segment.Extent{Len: 1}, make([]byte, 1)); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

// twoIncarnations returns node "n" at epoch 11 (n1), its next
// incarnation at epoch 22 (n2, not yet at the name), a client that read
// from n1 (so it pools a connection to it), and the extent it read.
func twoIncarnations(t *testing.T) (n1, n2 *tcpNode, tr *TCPTransport, addr *atomic.Value, e segment.Extent, dst []byte) {
	t.Helper()
	n1 = newTCPNode(t, testToken, 1<<20, TCPServerOptions{Epoch: 11})
	n2 = newTCPNode(t, testToken, 1<<20, TCPServerOptions{Epoch: 22})
	tr, addr = restartingPeer(t, n1)
	e = segment.Extent{Segment: 0, Off: 3, Len: 1000}
	dst = make([]byte, e.Len)
	if err := tr.ReadAt(context.Background(), "n", 11, e, dst); err != nil {
		t.Fatal(err)
	}
	return n1, n2, tr, addr, e, dst
}

// TestTCPStaleEpoch: extents of one incarnation of a node are never read
// from or written to the next one (same address, new memory).
func TestTCPStaleEpoch(t *testing.T) {
	n1, n2, tr, addr, e, dst := twoIncarnations(t)
	n1.srv.Close()
	addr.Store(n2.addr)
	before := bytes.Clone(n2.mem(t, e))
	if err := tr.ReadAt(context.Background(), "n", 11, e, dst); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("read of epoch 11 from epoch 22: %v", err)
	}
	if err := tr.WriteAt(context.Background(), "n", 11, 0, e, make([]byte, e.Len)); !errors.Is(err, ErrStaleEpoch) {
		t.Fatalf("write of epoch 11 to epoch 22: %v", err)
	}
	if !bytes.Equal(n2.mem(t, e), before) {
		t.Fatal("a stale write changed the new incarnation's memory")
	}
	if err := tr.ReadAt(context.Background(), "n", 22, e, dst); err != nil || !bytes.Equal(dst, before) {
		t.Fatalf("read of the current epoch: %v", err)
	}
}

// TestTCPRestartedPeerIsRedialed: a node that restarted under its name is
// read again by a client that pooled connections to its old incarnation:
// the pooled connection fails the epoch check, is closed (not pooled
// again) and a fresh one reaches the new daemon. A pooled connection its
// peer closed is noticed before a request goes out on it.
func TestTCPRestartedPeerIsRedialed(t *testing.T) {
	_, n2, tr, addr, e, dst := twoIncarnations(t)
	addr.Store(n2.addr) // n1's connection stays open: only its epoch is old
	for i := range 3 {
		if err := tr.ReadAt(context.Background(), "n", 22, e, dst); err != nil {
			t.Fatalf("read %d of the new incarnation: %v", i, err)
		}
	}
	if !bytes.Equal(dst, n2.mem(t, e)) {
		t.Fatal("wrong bytes from the new incarnation")
	}
	n2.srv.Close()
	n3 := newTCPNode(t, testToken, 1<<20, TCPServerOptions{Epoch: 33})
	addr.Store(n3.addr)
	waitClosed := time.Now().Add(5 * time.Second)
	for time.Now().Before(waitClosed) {
		// The server's close reaches the idle socket asynchronously.
		err := tr.ReadAt(context.Background(), "n", 33, e, dst)
		if err == nil {
			break
		}
		if !errors.Is(err, ErrUnreachable) {
			t.Fatalf("read after the peer closed: %v", err)
		}
	}
	if st := tr.Stats(); st.Dials != 3 {
		t.Fatalf("stats %+v, want 3 dials", st)
	}
}
