package transfer

import (
	"fmt"
	"sync"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/segment"
)

// gpuPiece is one request against GPU memory.
type gpuPiece struct {
	idx   int
	op    Op
	ctx   *cuda.Context
	dev   cuda.DevicePtr
	host  []byte         // segment memory (or a bounce buffer)
	ext   segment.Extent // host's extent, when local
	local bool           // host is ext of a local segment
	alloc cuda.DevicePtr // the allocation dev is in; 0: unknown
}

// follows reports whether q continues p in both memories: the same
// direction, q's bytes right after p's in the same GPU allocation (one
// copy may not span two) and in the same segment. Such pieces go as one
// copy.
func (q gpuPiece) follows(p gpuPiece) bool {
	return q.local && p.local && q.op == p.op && q.ctx == p.ctx && p.alloc != 0 && q.alloc == p.alloc &&
		q.dev == p.dev+cuda.DevicePtr(len(p.host)) &&
		q.ext.Segment == p.ext.Segment && q.ext.Off == p.ext.Off+p.ext.Len
}

// gpuChunk bounds one asynchronous copy, so that a long request keeps
// several copies queued on the stream and an error names a small range.
const gpuChunk = 256 << 20

// streamPool keeps a few streams per GPU context: copies of one batch go
// to one stream, in order; concurrent batches use different streams.
// Spreading one batch over two or four streams was no faster on the H200
// host (64 separate 256 KiB tensors a call: 19.8 us a tensor on one
// stream, 21.9 on two, 23.3 on four).
type streamPool struct {
	mu   sync.Mutex
	free map[*cuda.Context][]*cuda.Stream
	all  []*cuda.Stream
}

func (p *streamPool) get(ctx *cuda.Context) (*cuda.Stream, error) {
	p.mu.Lock()
	if l := p.free[ctx]; len(l) > 0 {
		s := l[len(l)-1]
		p.free[ctx] = l[:len(l)-1]
		p.mu.Unlock()
		return s, nil
	}
	p.mu.Unlock()
	s, err := ctx.NewStream()
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	p.all = append(p.all, s)
	p.mu.Unlock()
	return s, nil
}

func (p *streamPool) put(ctx *cuda.Context, s *cuda.Stream) {
	p.mu.Lock()
	if p.free == nil {
		p.free = make(map[*cuda.Context][]*cuda.Stream)
	}
	p.free[ctx] = append(p.free[ctx], s)
	p.mu.Unlock()
}

func (p *streamPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.all {
		_ = s.Close()
	}
	p.all, p.free = nil, nil
}

// gpuStream is a stream of a context that a flight queued copies on.
type gpuStream struct {
	ctx *cuda.Context
	s   *cuda.Stream
}

// queueGPU queues every piece as asynchronous copies on a stream of its
// context and returns the streams used, for syncGPU: the copy engine
// moves the bytes between the GPU and the segment directly, at full
// speed when the segment is pinned (cuMemHostRegister). Consecutive
// pieces adjacent in both memories (a batch of blocks of one tensor into
// extents reserved one after the other) go as one copy: at KV-block
// sizes the driver's cost per copy, not the bus, is the limit. A copy
// that fails fails every piece it carried.
func (e *Engine) queueGPU(pieces []gpuPiece) ([]gpuStream, []error) {
	var errs []error
	var used []gpuStream
	var copies uint64
	for i := 0; i < len(pieces); {
		p := pieces[i]
		run := 1
		if p.local {
			for i+run < len(pieces) && pieces[i+run].follows(pieces[i+run-1]) && p.ext.Len+pieces[i+run].ext.Len <= gpuChunk {
				p.ext.Len += pieces[i+run].ext.Len
				run++
			}
			if run > 1 {
				host, err := e.opts.Local.Bytes(p.ext)
				if err != nil {
					run = 1 // cannot happen: each part resolved; copy them apart
				} else {
					p.host = host
				}
			}
		}
		fail := func(err error) {
			for _, q := range pieces[i : i+run] {
				errs = append(errs, reqError(q.idx, err))
			}
		}
		var s *cuda.Stream
		for _, u := range used {
			if u.ctx == p.ctx {
				s = u.s
			}
		}
		if s == nil {
			var err error
			if s, err = e.streams.get(p.ctx); err != nil {
				fail(fmt.Errorf("stream: %w", err))
				i += run
				continue
			}
			used = append(used, gpuStream{p.ctx, s})
		}
		for off := 0; off < len(p.host); off += gpuChunk {
			end := min(off+gpuChunk, len(p.host))
			var err error
			if p.op == Write {
				err = cuda.CopyDtoHAsync(p.host[off:end], p.dev+cuda.DevicePtr(off), s)
			} else {
				err = cuda.CopyHtoDAsync(p.dev+cuda.DevicePtr(off), p.host[off:end], s)
			}
			if err != nil {
				fail(err)
				break
			}
			copies++
		}
		i += run
	}
	e.stats.gpuPieces.Add(uint64(len(pieces)))
	e.stats.gpuCopies.Add(copies)
	return used, errs
}

// syncGPU waits for the copies queued on used and gives the streams back.
func (e *Engine) syncGPU(used []gpuStream) []error {
	var errs []error
	for _, u := range used {
		if err := u.s.Sync(); err != nil {
			errs = append(errs, fmt.Errorf("gpu %d: %w", u.ctx.Ordinal(), err))
		}
		e.streams.put(u.ctx, u.s)
	}
	return errs
}

// copyGPU queues pieces and waits for them.
func (e *Engine) copyGPU(pieces []gpuPiece) []error {
	used, errs := e.queueGPU(pieces)
	return append(errs, e.syncGPU(used)...)
}
