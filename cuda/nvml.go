//go:build cgo

package cuda

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Discover lists the machine's GPUs through NVML (libnvidia-ml.so.1, loaded
// by go-nvml with dlopen): name, UUID, PCI bus id and memory, each with the
// CUDA ordinal of the same device matched by UUID (-1 where CUDA does not
// see it or is unavailable). NVML is started and shut down inside the call.
// Without NVML it returns an error wrapping ErrUnavailable.
func Discover() ([]GPU, error) {
	l := nvml.New()
	if ret := l.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND {
			return nil, fmt.Errorf("%w: nvml: libnvidia-ml.so.1 could not be loaded", ErrUnavailable)
		}
		return nil, fmt.Errorf("%w: nvml init: %s", ErrUnavailable, ret.Error())
	}
	defer l.Shutdown()

	n, ret := l.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("cuda: nvml device count: %s: %w", ret.Error(), ErrNVML)
	}
	ordinals := map[string]int{}
	if devs, err := Devices(); err == nil {
		for _, d := range devs {
			ordinals[d.UUID] = d.Ordinal
		}
	}
	gpus := make([]GPU, 0, n)
	for i := range n {
		d, ret := l.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml device %d: %s: %w", i, ret.Error(), ErrNVML)
		}
		g := GPU{Index: i, Ordinal: -1}
		if g.Name, ret = d.GetName(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml device %d name: %s: %w", i, ret.Error(), ErrNVML)
		}
		if g.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml device %d uuid: %s: %w", i, ret.Error(), ErrNVML)
		}
		pci, ret := d.GetPciInfo()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml device %d pci info: %s: %w", i, ret.Error(), ErrNVML)
		}
		g.PCIBusID = normalizeBusID(cString(pci.BusId[:]))
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml device %d memory: %s: %w", i, ret.Error(), ErrNVML)
		}
		g.MemoryTotal, g.MemoryUsed = mem.Total, mem.Used
		if o, ok := ordinals[g.UUID]; ok {
			g.Ordinal = o
		}
		gpus = append(gpus, g)
	}
	return gpus, nil
}

// cString reads a NUL-terminated C char array.
func cString(b []int8) string {
	s := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}
