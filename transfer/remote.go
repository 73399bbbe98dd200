package transfer

import (
	"context"
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

// pathRemote names the transport in statistics and metrics.
const pathRemote Path = "remote"

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
	)
	for _, p := range splitBounced(pieces) {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := e.remoteOne(ctx, p.req); err != nil {
				mu.Lock()
				if !failed[p.idx] {
					failed[p.idx] = true
					errs = append(errs, reqError(p.idx, fmt.Errorf("node %q %v: %w", p.req.Node, p.req.Extent, err)))
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
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

func (e *Engine) remoteOne(ctx context.Context, r Request) error {
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

// accountRemote counts remote requests: the bytes moved, one copy each.
func (e *Engine) accountRemote(pieces []remotePiece, d time.Duration) {
	var rd, wr uint64
	for _, p := range pieces {
		if p.req.Op == Read {
			rd += p.req.Extent.Len
		} else {
			wr += p.req.Extent.Len
		}
	}
	e.stats.read.Add(rd)
	e.stats.written.Add(wr)
	e.stats.copied.Add(rd + wr)
	e.stats.requests.Add(uint64(len(pieces)))
	pm := e.metrics.path(pathRemote)
	if rd > 0 {
		pm.read.Add(float64(rd))
	}
	if wr > 0 {
		pm.written.Add(float64(wr))
	}
	pm.copied.Add(float64(rd + wr))
	pm.latency.Observe(d.Seconds())
}
