package transfer

import (
	"fmt"
	"sync"

	"github.com/mooncake-fs/mooncake-fs/cuda"
)

// gpuPiece is one request against GPU memory.
type gpuPiece struct {
	idx  int
	op   Op
	ctx  *cuda.Context
	dev  cuda.DevicePtr
	host []byte // segment memory
}

// gpuChunk bounds one asynchronous copy, so that a long request keeps
// several copies queued on the stream and an error names a small range.
const gpuChunk = 256 << 20

// streamPool keeps a few streams per GPU context: copies of one batch go
// to one stream, in order; concurrent batches use different streams.
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

// queueGPU queues every piece as chunked asynchronous copies on a stream
// of its context and returns the streams used, for syncGPU: the copy
// engine moves the bytes between the GPU and the segment directly, at
// full speed when the segment is pinned (cuMemHostRegister).
func (e *Engine) queueGPU(pieces []gpuPiece) ([]gpuStream, []error) {
	var errs []error
	var used []gpuStream
	for _, p := range pieces {
		var s *cuda.Stream
		for _, u := range used {
			if u.ctx == p.ctx {
				s = u.s
			}
		}
		if s == nil {
			var err error
			if s, err = e.streams.get(p.ctx); err != nil {
				errs = append(errs, reqError(p.idx, fmt.Errorf("stream: %w", err)))
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
				errs = append(errs, reqError(p.idx, err))
				break
			}
		}
	}
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
