package rdmafake_test

import (
	"bytes"
	"errors"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/rdma"
	"github.com/mooncake-fs/mooncake-fs/rdma/rdmafake"
)

type pair struct {
	pa, pb *rdmafake.Provider
	da, db rdma.Device
	qa, qb rdma.QP
}

func newPair(t *testing.T) *pair {
	t.Helper()
	dir := t.TempDir()
	pa, err := rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"fa"}})
	if err != nil {
		t.Fatal(err)
	}
	pb, err := rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"fb"}, Jitter: 50 * time.Microsecond})
	if err != nil {
		t.Fatal(err)
	}
	p := &pair{pa: pa, pb: pb}
	if p.da, err = pa.Open("fa"); err != nil {
		t.Fatal(err)
	}
	if p.db, err = pb.Open("fb"); err != nil {
		t.Fatal(err)
	}
	p.qa, p.qb = connect(t, p.da, p.db)
	t.Cleanup(func() {
		p.qa.Close()
		p.qb.Close()
		p.da.Close()
		p.db.Close()
	})
	return p
}

func connect(t *testing.T, da, db rdma.Device) (rdma.QP, rdma.QP) {
	t.Helper()
	qa, err := da.CreateQP(16)
	if err != nil {
		t.Fatal(err)
	}
	qb, err := db.CreateQP(16)
	if err != nil {
		t.Fatal(err)
	}
	if err := qa.Connect(qb.Endpoint()); err != nil {
		t.Fatal(err)
	}
	if err := qb.Connect(qa.Endpoint()); err != nil {
		t.Fatal(err)
	}
	return qa, qb
}

func reg(t *testing.T, d rdma.Device, n int, acc rdma.Access) ([]byte, rdma.MR) {
	t.Helper()
	b := make([]byte, n)
	m, err := d.RegMR(b, acc)
	if err != nil {
		t.Fatal(err)
	}
	return b, m
}

// wait polls q until it has n completions.
func wait(t *testing.T, q rdma.QP, n int) []rdma.Completion {
	t.Helper()
	var out []rdma.Completion
	buf := make([]rdma.Completion, 8)
	deadline := time.Now().Add(10 * time.Second)
	for len(out) < n {
		k, err := q.Poll(buf)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, buf[:k]...)
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d completions after 10s", len(out), n)
		}
		time.Sleep(20 * time.Microsecond)
	}
	return out
}

const all = rdma.AccessLocalWrite | rdma.AccessRemoteRead | rdma.AccessRemoteWrite

func TestWriteAndRead(t *testing.T) {
	p := newPair(t)
	src, ms := reg(t, p.da, 8192, rdma.AccessLocalWrite)
	for i := range src {
		src[i] = byte(i * 7)
	}
	dst, md := reg(t, p.db, 8192, all)
	// A WRITE gathered from two SGEs lands at an offset of the remote MR.
	wr := rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, RKey: md.RKey(), Remote: md.Addr() + 100,
		Local: []rdma.SGE{{Addr: ms.Addr(), Len: 1000, LKey: ms.LKey()}, {Addr: ms.Addr() + 4000, Len: 24, LKey: ms.LKey()}}}
	if err := p.qa.Post([]rdma.WorkRequest{wr}); err != nil {
		t.Fatal(err)
	}
	c := wait(t, p.qa, 1)[0]
	if c.Status != rdma.StatusSuccess || c.ID != 1 || c.Bytes != 1024 {
		t.Fatalf("completion %+v", c)
	}
	want := append(append([]byte(nil), src[:1000]...), src[4000:4024]...)
	if !bytes.Equal(dst[100:1124], want) {
		t.Fatal("written bytes differ")
	}
	// A READ scatters them back.
	back, mb := reg(t, p.da, 1024, rdma.AccessLocalWrite)
	rd := rdma.WorkRequest{ID: 2, Op: rdma.OpRead, RKey: md.RKey(), Remote: md.Addr() + 100,
		Local: []rdma.SGE{{Addr: mb.Addr(), Len: 1024, LKey: mb.LKey()}}}
	if err := p.qa.Post([]rdma.WorkRequest{rd}); err != nil {
		t.Fatal(err)
	}
	if c := wait(t, p.qa, 1)[0]; c.Status != rdma.StatusSuccess {
		t.Fatalf("read %+v", c)
	}
	if !bytes.Equal(back, want) {
		t.Fatal("read bytes differ")
	}
	if s := p.pa.Stats(); s.Writes != 1 || s.Reads != 1 || s.Bytes != 2048 {
		t.Fatalf("stats %+v", s)
	}
}

// TestChecks: each bad request fails with the NIC's status, copies
// nothing, moves the QP to ERR and flushes what follows.
func TestChecks(t *testing.T) {
	cases := []struct {
		name string
		mk   func(local, remote rdma.MR) rdma.WorkRequest
		want rdma.Status
	}{
		{"bad rkey", func(l, r rdma.MR) rdma.WorkRequest {
			return rdma.WorkRequest{Op: rdma.OpWrite, RKey: r.RKey() + 1, Remote: r.Addr(), Local: []rdma.SGE{{Addr: l.Addr(), Len: 64, LKey: l.LKey()}}}
		}, rdma.StatusRemAccessErr},
		{"remote out of bounds", func(l, r rdma.MR) rdma.WorkRequest {
			return rdma.WorkRequest{Op: rdma.OpWrite, RKey: r.RKey(), Remote: r.Addr() + r.Len() - 10, Local: []rdma.SGE{{Addr: l.Addr(), Len: 64, LKey: l.LKey()}}}
		}, rdma.StatusRemAccessErr},
		{"bad lkey", func(l, r rdma.MR) rdma.WorkRequest {
			return rdma.WorkRequest{Op: rdma.OpWrite, RKey: r.RKey(), Remote: r.Addr(), Local: []rdma.SGE{{Addr: l.Addr(), Len: 64, LKey: l.LKey() ^ 1}}}
		}, rdma.StatusLocProtErr},
		{"local out of bounds", func(l, r rdma.MR) rdma.WorkRequest {
			return rdma.WorkRequest{Op: rdma.OpRead, RKey: r.RKey(), Remote: r.Addr(), Local: []rdma.SGE{{Addr: l.Addr() + 4000, Len: 200, LKey: l.LKey()}}}
		}, rdma.StatusLocProtErr},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t)
			_, l := reg(t, p.da, 4096, rdma.AccessLocalWrite)
			dst, r := reg(t, p.db, 4096, all)
			ok := rdma.WorkRequest{Op: rdma.OpWrite, RKey: r.RKey(), Remote: r.Addr(), Local: []rdma.SGE{{Addr: l.Addr(), Len: 64, LKey: l.LKey()}}}
			bad := tc.mk(l, r)
			bad.ID, ok.ID = 1, 2
			if err := p.qa.Post([]rdma.WorkRequest{bad, ok}); err != nil {
				t.Fatal(err)
			}
			cs := wait(t, p.qa, 2)
			if cs[0].Status != tc.want || cs[1].Status != rdma.StatusFlushErr {
				t.Fatalf("completions %v %v, want %v then flushed", cs[0].Status, cs[1].Status, tc.want)
			}
			if p.qa.State() != rdma.QPError {
				t.Fatalf("state %v", p.qa.State())
			}
			if bytes.Count(dst, []byte{0}) != len(dst) {
				t.Fatal("a failed request wrote")
			}
			// Posts to a QP in ERR are flushed too.
			if err := p.qa.Post([]rdma.WorkRequest{ok}); err != nil {
				t.Fatal(err)
			}
			if c := wait(t, p.qa, 1)[0]; c.Status != rdma.StatusFlushErr {
				t.Fatalf("post after error: %v", c.Status)
			}
		})
	}
}

func TestAccessRights(t *testing.T) {
	p := newPair(t)
	_, l := reg(t, p.da, 4096, rdma.AccessLocalWrite)
	_, ro := reg(t, p.db, 4096, rdma.AccessRemoteRead)
	w := small(1, rdma.OpWrite, l, ro)
	p.qa.Post([]rdma.WorkRequest{w})
	if c := wait(t, p.qa, 1)[0]; c.Status != rdma.StatusRemAccessErr {
		t.Fatalf("write to a read-only MR: %v", c.Status)
	}
	// A READ needs LOCAL_WRITE on its target.
	qa, _ := connect(t, p.da, p.db)
	defer qa.Close()
	_, lro := reg(t, p.da, 4096, 0)
	r := small(2, rdma.OpRead, lro, ro)
	qa.Post([]rdma.WorkRequest{r})
	if c := wait(t, qa, 1)[0]; c.Status != rdma.StatusLocProtErr {
		t.Fatalf("read into a read-only MR: %v", c.Status)
	}
}

func TestStaleRegistration(t *testing.T) {
	p := newPair(t)
	_, l := reg(t, p.da, 4096, rdma.AccessLocalWrite)
	_, r := reg(t, p.db, 4096, all)
	key, addr := r.RKey(), r.Addr()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err == nil {
		t.Fatal("second Close of an MR succeeded")
	}
	w := rdma.WorkRequest{ID: 1, Op: rdma.OpWrite, RKey: key, Remote: addr, Local: []rdma.SGE{{Addr: l.Addr(), Len: 8, LKey: l.LKey()}}}
	p.qa.Post([]rdma.WorkRequest{w})
	if c := wait(t, p.qa, 1)[0]; c.Status != rdma.StatusRemAccessErr {
		t.Fatalf("write through a deregistered rkey: %v", c.Status)
	}
}

func TestUnconnectedPeer(t *testing.T) {
	p := newPair(t)
	_, l := reg(t, p.da, 4096, rdma.AccessLocalWrite)
	_, r := reg(t, p.db, 4096, all)
	// A QP of a that b's QP was not connected to: b drops its packets.
	q, err := p.da.CreateQP(4)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if err := q.Post([]rdma.WorkRequest{{Op: rdma.OpWrite}}); err == nil {
		t.Fatal("post on a RESET QP succeeded")
	}
	if err := q.Connect(p.qb.Endpoint()); err != nil {
		t.Fatal(err)
	}
	w := small(1, rdma.OpWrite, l, r)
	q.Post([]rdma.WorkRequest{w})
	if c := wait(t, q, 1)[0]; c.Status != rdma.StatusRetryExcErr {
		t.Fatalf("write from a stranger QP: %v", c.Status)
	}
}

func TestInject(t *testing.T) {
	p := newPair(t)
	_, l := reg(t, p.da, 4096, rdma.AccessLocalWrite)
	_, r := reg(t, p.db, 4096, all)
	w := small(1, rdma.OpWrite, l, r)
	p.pa.Inject(rdmafake.FaultRemoteAccess)
	p.qa.Post([]rdma.WorkRequest{w})
	if c := wait(t, p.qa, 1)[0]; c.Status != rdma.StatusRemAccessErr {
		t.Fatalf("injected remote access error: %v", c.Status)
	}
	qa, _ := connect(t, p.da, p.db)
	p.pa.Inject(rdmafake.FaultTimeout)
	qa.Post([]rdma.WorkRequest{w})
	time.Sleep(20 * time.Millisecond)
	if n, _ := qa.Poll(make([]rdma.Completion, 1)); n != 0 {
		t.Fatal("a timed-out request completed")
	}
	qa.Close() // does not hang on the lost completion
}

func TestOrderAcrossQPs(t *testing.T) {
	p := newPair(t)
	src, l := reg(t, p.da, 1<<16, rdma.AccessLocalWrite)
	for i := range src {
		src[i] = byte(i)
	}
	dst, r := reg(t, p.db, 1<<16, all)
	qa2, _ := connect(t, p.db, p.da) // b -> a, jittered
	defer qa2.Close()
	var wrs []rdma.WorkRequest
	for i := range 16 {
		off := uint64(i) * 4096
		wrs = append(wrs, rdma.WorkRequest{ID: uint64(i), Op: rdma.OpWrite, RKey: r.RKey(), Remote: r.Addr() + off,
			Local: []rdma.SGE{{Addr: l.Addr() + off, Len: 4096, LKey: l.LKey()}}})
	}
	if err := p.qa.Post(wrs); err != nil {
		t.Fatal(err)
	}
	for i, c := range wait(t, p.qa, 16) {
		if c.ID != uint64(i) || c.Status != rdma.StatusSuccess {
			t.Fatalf("completion %d: %+v (one QP completes in order)", i, c)
		}
	}
	if !bytes.Equal(src, dst) {
		t.Fatal("bytes differ")
	}
	// Beyond the depth: the ones that fit are queued, the call fails.
	if err := p.qa.Post(append(wrs, wrs[0])); err == nil {
		t.Fatal("post beyond the QP's depth succeeded")
	}
	if cs := wait(t, p.qa, 16); cs[15].Status != rdma.StatusSuccess {
		t.Fatalf("the queued part: %+v", cs[15])
	}
}

// small is an 8-byte request between the starts of local and remote.
func small(id uint64, op rdma.Opcode, local, remote rdma.MR) rdma.WorkRequest {
	return rdma.WorkRequest{ID: id, Op: op, RKey: remote.RKey(), Remote: remote.Addr(),
		Local: []rdma.SGE{{Addr: local.Addr(), Len: 8, LKey: local.LKey()}}}
}

// TestDmabuf: device memory registered through a dma-buf moves like any
// MR, within its bounds only; a descriptor that is no dma-buf, or a
// range past its end, is refused, and so is every dma-buf where the
// fake has no device memory.
func TestDmabuf(t *testing.T) {
	dir := t.TempDir()
	gpu := &rdmafake.HostMemory{Base: 0x7f0000000000, Mem: make([]byte, 1<<16), Dmabufs: map[int]uint64{42: 1 << 16}}
	for i := range gpu.Mem {
		gpu.Mem[i] = byte(i*13 + 1)
	}
	pa, err := rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"ga"}, DeviceMemory: gpu})
	if err != nil {
		t.Fatal(err)
	}
	pb, err := rdmafake.New(rdmafake.Options{Dir: dir, Devices: []string{"gb"}})
	if err != nil {
		t.Fatal(err)
	}
	da, _ := pa.Open("ga")
	db, _ := pb.Open("gb")
	defer da.Close()
	defer db.Close()
	if _, err := db.RegDmabufMR(42, 0, 4096, gpu.Base, rdma.AccessLocalWrite); !errors.Is(err, rdma.ErrUnavailable) {
		t.Errorf("dma-buf on a fake without device memory: %v", err)
	}
	for _, bad := range [][3]uint64{{7, 0, 4096}, {42, 1 << 15, 1 << 16}, {42, 0, 0}} {
		if _, err := da.RegDmabufMR(int(bad[0]), bad[1], bad[2], gpu.Base, rdma.AccessLocalWrite); err == nil {
			t.Errorf("dma-buf registration %v succeeded", bad)
		}
	}
	mg, err := da.RegDmabufMR(42, 0, 1<<15, gpu.Base+4096, rdma.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	qa, qb := connect(t, da, db)
	defer qa.Close()
	defer qb.Close()
	host, mh := reg(t, db, 8192, all)
	post := func(w rdma.WorkRequest) rdma.Status {
		t.Helper()
		if err := qa.Post([]rdma.WorkRequest{w}); err != nil {
			t.Fatal(err)
		}
		return wait(t, qa, 1)[0].Status
	}
	// GPU to host, then host back into another place of the GPU.
	if st := post(rdma.WorkRequest{Op: rdma.OpWrite, RKey: mh.RKey(), Remote: mh.Addr(),
		Local: []rdma.SGE{{Addr: mg.Addr() + 100, Len: 8000, LKey: mg.LKey()}}}); st != rdma.StatusSuccess {
		t.Fatalf("write from device memory: %v", st)
	}
	if !bytes.Equal(host[:8000], gpu.Mem[4196:12196]) {
		t.Fatal("bytes written from device memory differ")
	}
	if st := post(rdma.WorkRequest{Op: rdma.OpRead, RKey: mh.RKey(), Remote: mh.Addr(),
		Local: []rdma.SGE{{Addr: mg.Addr() + 20000, Len: 8000, LKey: mg.LKey()}}}); st != rdma.StatusSuccess {
		t.Fatalf("read into device memory: %v", st)
	}
	if !bytes.Equal(gpu.Mem[24096:32096], host[:8000]) {
		t.Fatal("bytes read into device memory differ")
	}
	// Past the registered range: a local protection error, nothing moves.
	before := append([]byte(nil), host...)
	if st := post(rdma.WorkRequest{Op: rdma.OpWrite, RKey: mh.RKey(), Remote: mh.Addr(),
		Local: []rdma.SGE{{Addr: mg.Addr() + 1<<15 - 10, Len: 100, LKey: mg.LKey()}}}); st != rdma.StatusLocProtErr {
		t.Fatalf("write past the dma-buf range: %v", st)
	}
	if !bytes.Equal(host, before) {
		t.Fatal("a refused request moved bytes")
	}
	if err := mg.Close(); err != nil {
		t.Fatal(err)
	}
}
