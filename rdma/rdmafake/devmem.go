package rdmafake

import "fmt"

// HostMemory is DeviceMemory for tests on machines without a GPU:
// device addresses from Base on name the bytes of Mem, and the dma-bufs
// are the descriptors Dmabufs lists, each with its size. On a GPU host
// the daemon gives the fake the GPU's own memory instead.
type HostMemory struct {
	Base    uint64
	Mem     []byte
	Dmabufs map[int]uint64
}

// Check implements DeviceMemory.
func (h *HostMemory) Check(fd int, offset, length uint64) error {
	size, ok := h.Dmabufs[fd]
	switch {
	case !ok:
		return fmt.Errorf("fd %d is not a dma-buf (EINVAL)", fd)
	case offset > size || length > size-offset:
		return fmt.Errorf("%d B at %d of a %d B dma-buf (EINVAL)", length, offset, size)
	}
	return nil
}

func (h *HostMemory) span(addr uint64, n int) ([]byte, error) {
	if addr < h.Base || uint64(n) > uint64(len(h.Mem)) || addr-h.Base > uint64(len(h.Mem)-n) {
		return nil, fmt.Errorf("device range %#x+%d outside %#x+%d", addr, n, h.Base, len(h.Mem))
	}
	o := addr - h.Base
	return h.Mem[o : o+uint64(n)], nil
}

// Read implements DeviceMemory.
func (h *HostMemory) Read(dst []byte, addr uint64) error {
	b, err := h.span(addr, len(dst))
	if err == nil {
		copy(dst, b)
	}
	return err
}

// Write implements DeviceMemory.
func (h *HostMemory) Write(addr uint64, src []byte) error {
	b, err := h.span(addr, len(src))
	if err == nil {
		copy(b, src)
	}
	return err
}
