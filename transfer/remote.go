package transfer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/segment"
)

// Remote requests: extents of other nodes' segments, moved by the
// Transport. Host and registered buffers go to the socket as they are (one
// copy, by the kernel); another process's memory and GPU memory pass
// through a bounce buffer of at most bounceBytes per request in flight, so
// nothing is staged whole.

const (
	bounceBytes    = 4 << 20
	remoteParallel = 8 // requests in flight per Submit
)

type remotePiece struct {
	idx int
	req Request
}

var bouncePool = sync.Pool{New: func() any { b := make([]byte, bounceBytes); return &b }}

// copyRemote runs the pieces, several at a time. Pieces that go through
// a bounce buffer are cut into bounce-sized ones first, so that one large
// extent keeps several transfers and local copies in flight at once.
func (e *Engine) copyRemote(ctx context.Context, pieces []remotePiece) []error {
	var (
		mu     sync.Mutex
		errs   []error
		failed = map[int]bool{}
		wg     sync.WaitGroup
		sem    = make(chan struct{}, remoteParallel)
		tally  [nPaths]pathTally
	)
	for _, p := range splitBounced(pieces) {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			start := time.Now()
			path, copied, err := e.remoteOne(ctx, p.req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if !failed[p.idx] {
					failed[p.idx] = true
					errs = append(errs, reqError(p.idx, fmt.Errorf("node %q %v: %w", p.req.Node, p.req.Extent, err)))
				}
				return
			}
			t := &tally[path]
			if p.req.Op == Read {
				t.rd += p.req.Extent.Len
				t.crd += copied
			} else {
				t.wr += p.req.Extent.Len
				t.cwr += copied
			}
			t.n++
			t.d = max(t.d, time.Since(start))
		})
	}
	wg.Wait()
	for i := range tally {
		if t := tally[i]; t.n > 0 {
			e.accountPath(pathID(i), t)
		}
	}
	return errs
}

// splitBounced cuts the pieces whose buffers need a bounce buffer
// (another process's memory, GPU memory) into pieces of at most
// bounceBytes; the others stay whole.
func splitBounced(pieces []remotePiece) []remotePiece {
	var out []remotePiece
	for _, p := range pieces {
		if k := p.req.Buf.Kind; (k != ProcessVM && k != CUDA) || p.req.Extent.Len <= bounceBytes {
			out = append(out, p)
			continue
		}
		for off := uint64(0); off < p.req.Extent.Len; off += bounceBytes {
			q := p
			q.req.Extent.Off += off
			q.req.Extent.Len = min(bounceBytes, p.req.Extent.Len-off)
			q.req.BufOff += off
			out = append(out, q)
		}
	}
	return out
}

// remoteOne moves one piece: over RDMA where the peer has it, else over
// the Transport. It returns the path taken and the bytes copied locally.
func (e *Engine) remoteOne(ctx context.Context, r Request) (pathID, uint64, error) {
	if rd := e.opts.RDMA; rd != nil {
		p, copied, err := e.remoteRDMA(ctx, rd, r)
		if !errors.Is(err, errNoCommonPath) {
			return p, copied, err
		}
		rd.stats.fallbacks.Add(1)
	}
	return idTCP, r.Extent.Len, e.remoteTCP(ctx, r)
}

func (e *Engine) remoteTCP(ctx context.Context, r Request) error {
	t := e.opts.Remote
	switch r.Buf.Kind {
	case Host, Registered:
		b := r.Buf.Mem[r.BufOff : r.BufOff+r.Extent.Len]
		if r.Op == Read {
			return e.read(ctx, r, r.Extent, b)
		}
		return t.WriteAt(ctx, r.Node, r.Epoch, r.Resv, r.Extent, b)
	case ProcessVM, CUDA:
		bp := bouncePool.Get().(*[]byte)
		defer bouncePool.Put(bp)
		for done := uint64(0); done < r.Extent.Len; {
			n := min(uint64(bounceBytes), r.Extent.Len-done)
			ext := r.Extent
			ext.Off += done
			ext.Len = n
			stage := (*bp)[:n]
			local := Request{Op: r.Op, Buf: r.Buf, BufOff: r.BufOff + done, Extent: ext}
			if r.Op == Write {
				if err := e.bounce(local, stage); err != nil {
					return err
				}
				if err := t.WriteAt(ctx, r.Node, r.Epoch, r.Resv, ext, stage); err != nil {
					return err
				}
			} else {
				if err := e.read(ctx, r, ext, stage); err != nil {
					return err
				}
				if err := e.bounce(local, stage); err != nil {
					return err
				}
			}
			done += n
		}
		return nil
	}
	return fmt.Errorf("buffer kind %v: %w", r.Buf.Kind, ErrNoStrategy)
}

// remoteRDMA moves r over RDMA: straight from and to registered memory,
// else through the registered bounce pool (one local copy per byte).
// errNoCommonPath: the peer or the request needs TCP.
func (e *Engine) remoteRDMA(ctx context.Context, rd *RDMA, r Request) (pathID, uint64, error) {
	if r.Op == Write && r.Resv == 0 {
		return 0, 0, errNoCommonPath
	}
	if err := rd.begin(); err != nil {
		return 0, 0, err
	}
	defer rd.end() // Close waits for the staged copies too
	d := rd.deviceFor(r.Buf)
	if s, err := rd.session(ctx, r.Node, d); err != nil || s == nil {
		if err == nil {
			err = errNoCommonPath
		}
		return 0, 0, err
	}
	var buf []byte
	switch r.Buf.Kind {
	case Host, Registered:
		buf = r.Buf.Mem[r.BufOff : r.BufOff+r.Extent.Len]
		if lkey, ok := rd.regs.lookup(addrOf(buf), r.Extent.Len, d); ok {
			return idRDMADirect, 0, rd.move(ctx, r, r.Extent, addrOf(buf), d, lkey)
		}
	case CUDA:
		// GPUDirect RDMA: GPU memory registered through its dma-buf.
		dev := uint64(r.Buf.Dev) + r.BufOff
		if lkey, ok := rd.gpuRegs.lookup(dev, r.Extent.Len, d); ok {
			return idRDMADirect, 0, rd.move(ctx, r, r.Extent, dev, d, lkey)
		}
	}
	// Staged, a pool buffer at a time; a checked read is checked once,
	// after its last piece.
	lkey := rd.mu.poolReg.mrs[d].LKey()
	chunk := r
	chunk.Version = 0
	var epoch uint64 // of the owner the pieces reached: one for all
	for done := uint64(0); done < r.Extent.Len; {
		n := min(rd.opts.ChunkBytes, r.Extent.Len-done)
		stage, release, err := rd.stage(ctx, int(n))
		if err != nil {
			return 0, 0, err
		}
		ext := r.Extent
		ext.Off += done
		ext.Len = n
		local := Request{Op: r.Op, Buf: r.Buf, BufOff: r.BufOff + done, Extent: ext}
		var got uint64
		if r.Op == Write {
			if err = e.stageCopy(local, buf, done, stage); err == nil {
				got, err = rd.moveEpoch(ctx, chunk, ext, addrOf(stage), d, lkey)
			}
		} else if got, err = rd.moveEpoch(ctx, chunk, ext, addrOf(stage), d, lkey); err == nil {
			err = e.stageCopy(local, buf, done, stage)
		}
		release()
		if err == nil && epoch != 0 && got != epoch {
			err = fmt.Errorf("%w: the owner restarted during the request", ErrStaleEpoch)
		}
		if err != nil {
			return 0, 0, err
		}
		epoch = got
		chunk.Epoch = epoch
		done += n
	}
	if r.Op == Read && r.Version != 0 {
		if err := rd.check(ctx, r, epoch); err != nil {
			return 0, 0, err
		}
	}
	return idRDMAStaged, r.Extent.Len, nil
}

// stageCopy copies between a request's buffer and a bounce buffer:
// memcpy for host memory (buf, at off), else the kind's local strategy.
func (e *Engine) stageCopy(r Request, buf []byte, off uint64, stage []byte) error {
	if buf == nil {
		return e.bounce(r, stage)
	}
	part := buf[off : off+uint64(len(stage))]
	p := memPair{guard: r.Buf.Kind == Registered}
	if r.Op == Write {
		return p.copy(stage, part)
	}
	return p.copy(part, stage)
}

// read reads ext (part of r's extent) into dst, checked when r says so.
func (e *Engine) read(ctx context.Context, r Request, ext segment.Extent, dst []byte) error {
	if r.Version != 0 {
		return e.opts.Remote.ReadBody(ctx, r.Node, r.Epoch, r.Body, r.Version, ext, dst)
	}
	return e.opts.Remote.ReadAt(ctx, r.Node, r.Epoch, ext, dst)
}

// bounce copies between the request's buffer and stage (standing in for
// the remote extent) with the local strategy of the buffer's kind.
func (e *Engine) bounce(r Request, stage []byte) error {
	var errs []error
	switch r.Buf.Kind {
	case ProcessVM:
		errs = e.copyVM([]vmPiece{{op: r.Op, pid: r.Buf.Pid, addr: r.Buf.Addr + r.BufOff, local: stage}}, uint64(len(stage)))
	case CUDA:
		errs = e.copyGPU([]gpuPiece{{op: r.Op, ctx: r.Buf.Ctx, dev: r.Buf.Dev + cuda.DevicePtr(r.BufOff), host: stage}})
	}
	if len(errs) > 0 {
		return errs[0]
	}
	return nil
}

type pathTally struct {
	rd, wr, crd, cwr uint64
	n                int
	d                time.Duration
}

// accountPath counts remote pieces of one path.
func (e *Engine) accountPath(id pathID, t pathTally) {
	e.stats.read.Add(t.rd)
	e.stats.written.Add(t.wr)
	e.stats.copied.Add(t.crd + t.cwr)
	e.stats.requests.Add(uint64(t.n))
	e.stats.paths[id].add(t.rd, t.wr, t.crd, t.cwr, t.n)
	pm := e.metrics.path(pathNames[id])
	if t.rd > 0 {
		pm.read.Add(float64(t.rd))
	}
	if t.wr > 0 {
		pm.written.Add(float64(t.wr))
	}
	pm.copied.Add(float64(t.crd + t.cwr))
	pm.latency.Observe(t.d.Seconds())
}
