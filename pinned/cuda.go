package pinned

import (
	"fmt"

	"github.com/mooncake-fs/mooncake-fs/cuda"
)

// CUDAPin registers regions with CUDA (cuMemHostRegister, portable to
// every context) up to a quota, so that GPU copies into and out of them
// run at PCIe line rate instead of pageable speed. A failure is not fatal:
// the region stays usable and the failure is returned as a warning.
type CUDAPin struct {
	ctx    *cuda.Context
	quota  uint64
	pinned uint64
	done   []*Region
}

// NewCUDAPin pins through ctx, at most quota bytes in all.
func NewCUDAPin(ctx *cuda.Context, quota uint64) *CUDAPin {
	return &CUDAPin{ctx: ctx, quota: quota}
}

// Pin registers r if the quota allows; it returns a warning (not an
// error) when r stays pageable.
func (p *CUDAPin) Pin(r *Region) string {
	size := uint64(len(r.Bytes()))
	if p.pinned+size > p.quota {
		return fmt.Sprintf("segment of %d B not pinned for CUDA: quota %d B (%d used); GPU copies into it run at pageable speed", size, p.quota, p.pinned)
	}
	if err := p.ctx.HostRegister(r.Bytes(), cuda.HostRegisterPortable); err != nil {
		return fmt.Sprintf("segment not pinned for CUDA (%v); GPU copies into it run at pageable speed", err)
	}
	p.pinned += size
	p.done = append(p.done, r)
	r.mu.Lock()
	r.mu.cudaPinned = true
	r.mu.Unlock()
	return ""
}

// Pinned returns the bytes registered with CUDA.
func (p *CUDAPin) Pinned() uint64 { return p.pinned }

// Unpin unregisters every region it pinned. Failures are returned joined
// for the caller to log; the quota is given back regardless.
func (p *CUDAPin) Unpin() []error {
	var errs []error
	for _, r := range p.done {
		if err := p.ctx.HostUnregister(r.Bytes()); err != nil {
			errs = append(errs, err)
		}
		r.mu.Lock()
		r.mu.cudaPinned = false
		r.mu.Unlock()
	}
	p.done, p.pinned = nil, 0
	return errs
}
