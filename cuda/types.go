package cuda

import (
	"fmt"
	"strings"
)

// LibraryEnv names the environment variable that overrides where libcuda is
// loaded from (a path to the library file). When it is set, that path alone
// is tried.
const LibraryEnv = "MOONCAKE_LIBCUDA"

// IpcHandleSize is the size of a CUDA IPC memory handle (CUipcMemHandle).
const IpcHandleSize = 64

// DevicePtr is a device address in this process's unified address space
// (CUdeviceptr). Offsets into an allocation are plain additions.
type DevicePtr uint64

// Device describes one CUDA device as the driver numbers it in this
// process (CUDA_VISIBLE_DEVICES applies).
type Device struct {
	Ordinal     int    // CUDA device ordinal, 0-based
	Name        string // e.g. "NVIDIA H200"
	UUID        string // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
	PCIBusID    string // "dddd:bb:dd.f", lower case, as under /sys/bus/pci/devices
	MemoryBytes uint64 // total device memory
}

// GPU is one device as NVML sees it (all GPUs of the machine, whatever
// CUDA_VISIBLE_DEVICES says), with the CUDA ordinal of the same device.
type GPU struct {
	Index       int    // NVML index
	Ordinal     int    // CUDA ordinal matched by UUID; -1 if CUDA does not see it (or is unavailable)
	Name        string // e.g. "NVIDIA H200"
	UUID        string // "GPU-..."; the key that ties NVML to CUDA
	PCIBusID    string // "dddd:bb:dd.f", lower case
	MemoryTotal uint64 // bytes
	MemoryUsed  uint64 // bytes, by every process on the GPU
}

// HostRegisterFlags are the flags of cuMemHostRegister.
type HostRegisterFlags uint32

const (
	// HostRegisterPortable: the memory counts as pinned for every CUDA
	// context in the process, not only the one it was registered in. Pinned
	// segments are registered with it so any device's stream copies at
	// full speed.
	HostRegisterPortable HostRegisterFlags = 0x01
	// HostRegisterDeviceMap: also map the memory into the device address space.
	HostRegisterDeviceMap HostRegisterFlags = 0x02
	// HostRegisterIOMemory: the pointer is to I/O memory (a PCI BAR).
	HostRegisterIOMemory HostRegisterFlags = 0x04
	// HostRegisterReadOnly: the device will only read the memory.
	HostRegisterReadOnly HostRegisterFlags = 0x08
)

// formatUUID writes a CUuuid the way nvidia-smi and NVML do.
func formatUUID(b [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// normalizeBusID turns the driver's and NVML's spellings of a PCI address
// ("0000:1B:00.0", "00000000:1B:00.0") into the sysfs one ("0000:1b:00.0").
func normalizeBusID(s string) string {
	s = strings.ToLower(strings.TrimSpace(s))
	dom, rest, ok := strings.Cut(s, ":")
	if !ok {
		return s
	}
	if len(dom) > 4 && strings.Trim(dom[:len(dom)-4], "0") == "" {
		dom = dom[len(dom)-4:]
	}
	return dom + ":" + rest
}
