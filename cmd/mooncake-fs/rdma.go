package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/sirupsen/logrus"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/pinned"
	"github.com/mooncake-fs/mooncake-fs/rdma"
	"github.com/mooncake-fs/mooncake-fs/rdma/rdmafake"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// rdmaConfig is the RDMA part of the mount flags.
type rdmaConfig struct {
	mode    string   // auto or off
	devices []string // --rdma-devices; empty: any
	fake    string   // --rdma-fake: a software NIC's fabric folder (tests)
}

// RDMAStatus is the RDMA section of the status document.
type RDMAStatus struct {
	// State is "on", "off" (by flag, or not in a cluster) or
	// "unavailable".
	State    string   `json:"state"`
	Reason   string   `json:"reason,omitempty"`
	Provider string   `json:"provider,omitempty"`
	Devices  []string `json:"devices,omitempty"` // one rail each, in rail order
	Default  string   `json:"default,omitempty"` // the device of host memory
	// NearGPU is the device that moves each GPU's memory, by CUDA ordinal.
	NearGPU map[int]string      `json:"near_gpu,omitempty"`
	Stats   *transfer.RDMAStats `json:"stats,omitempty"`
}

// rdmaState is the daemon's RDMA path, once started.
type rdmaState struct {
	status RDMAStatus
	prov   rdma.Provider
	devs   []rdma.Device
	path   *transfer.RDMA
}

// startRDMA opens the RDMA device a cluster node moves remote bytes
// with, registers the segments and the bounce pool, or says why not. It
// never fails the mount: without RDMA every remote byte goes over TCP.
func (d *daemon) startRDMA() {
	st := &rdmaState{}
	d.rdma = st
	c := d.cfg.rdma
	switch {
	case c.mode == "off":
		st.status = RDMAStatus{State: "off", Reason: "--rdma off"}
		return
	case d.cl == nil:
		st.status = RDMAStatus{State: "off", Reason: "one machine: nothing is remote"}
		return
	}
	var err error
	if c.fake != "" {
		fo := rdmafake.Options{Dir: c.fake, Devices: []string{"fake-" + d.cfg.node}}
		if d.gpuCtx != nil {
			fo.DeviceMemory = gpuMemory{d.gpuCtx} // GPUDirect, as a NIC with peer memory
		}
		st.prov, err = rdmafake.New(fo)
	} else {
		st.prov = rdma.Verbs()
	}
	var def int
	if err == nil {
		st.devs, def, err = openRDMA(st.prov, c.devices, d.cpuNUMA())
	}
	var near map[int]int
	if err == nil {
		near = nearGPU(st.devs, d.gpus)
		st.path, err = transfer.NewRDMA(transfer.RDMAOptions{Devices: st.devs, Default: def, NearGPU: near, Control: d.cl.tr, Self: d.cfg.node,
			Log: func(f string, a ...any) { d.log.Infof(f, a...) }})
	}
	if err == nil {
		for _, s := range d.segs.Segments() {
			if err = st.path.RegisterSegment(s.ID, s.Mem); err != nil {
				break
			}
		}
	}
	if err != nil {
		st.close(d.log)
		st.path, st.devs = nil, nil
		st.status = RDMAStatus{State: "unavailable", Reason: err.Error()}
		if st.prov != nil {
			st.status.Provider = st.prov.Name()
		}
		lvl := logrus.InfoLevel
		if len(c.devices) > 0 || c.fake != "" {
			lvl = logrus.WarnLevel // asked for by name
		}
		d.log.WithError(err).Log(lvl, "RDMA unavailable: remote transfers use TCP")
		return
	}
	st.status = RDMAStatus{State: "on", Provider: st.prov.Name(), Devices: st.path.Devices(), Default: st.path.Devices()[def]}
	for g, i := range near {
		if st.status.NearGPU == nil {
			st.status.NearGPU = map[int]string{}
		}
		st.status.NearGPU[g] = st.status.Devices[i]
	}
	d.log.WithFields(logrus.Fields{"provider": st.prov.Name(), "devices": strings.Join(st.status.Devices, ","),
		"gpus": st.status.NearGPU}).Info("RDMA on")
}

// openRDMA opens the devices to use, one rail each, and says which is the
// default (host memory): those named that are up, in the flag's order
// (the first is the default), or all that are up by name (the same order
// on every node: rail i meets rail i), the default one on the NUMA node
// of the daemon's CPUs (and so of its segments).
func openRDMA(p rdma.Provider, names []string, numa int) ([]rdma.Device, int, error) {
	infos, err := p.Devices()
	if err != nil {
		return nil, 0, err
	}
	if len(infos) == 0 {
		return nil, 0, fmt.Errorf("%w: no RDMA devices", rdma.ErrUnavailable)
	}
	var pick []rdma.DeviceInfo
	var down []string
	for _, di := range infos {
		if len(names) > 0 && !slices.Contains(names, di.Name) {
			continue
		}
		if !di.PortUp {
			down = append(down, fmt.Sprintf("%s port %d is down", di.Name, di.Port))
			continue
		}
		pick = append(pick, di)
	}
	if len(names) > 0 {
		slices.SortStableFunc(pick, func(a, b rdma.DeviceInfo) int {
			return slices.Index(names, a.Name) - slices.Index(names, b.Name)
		})
	} else {
		slices.SortFunc(pick, func(a, b rdma.DeviceInfo) int { return strings.Compare(a.Name, b.Name) })
	}
	if len(pick) == 0 {
		if len(down) > 0 {
			return nil, 0, fmt.Errorf("%w: %s", rdma.ErrUnavailable, strings.Join(down, "; "))
		}
		return nil, 0, fmt.Errorf("%w: none of --rdma-devices %s exists", rdma.ErrUnavailable, strings.Join(names, ","))
	}
	var errs []error
	var devs []rdma.Device
	def := -1
	for _, di := range pick {
		dev, err := p.Open(di.Name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if def < 0 && len(names) == 0 && numa >= 0 && di.NUMANode == numa {
			def = len(devs)
		}
		devs = append(devs, dev)
	}
	if len(devs) == 0 {
		return nil, 0, errors.Join(errs...)
	}
	return devs, max(def, 0), nil
}

// nearGPU picks for each GPU the device closest to it on the PCIe tree
// (the longest common sysfs path: under one switch first), then on its
// NUMA node: GPUDirect RDMA through a far device crosses the CPUs'
// interconnect.
func nearGPU(devs []rdma.Device, gpus []cuda.GPU) map[int]int {
	if len(devs) < 2 {
		return nil
	}
	m := map[int]int{}
	for _, g := range gpus {
		if g.Ordinal < 0 {
			continue
		}
		gp := pciPath(g.PCIBusID)
		gn := pciNUMA(g.PCIBusID)
		best, bestScore := 0, -1
		for i, d := range devs {
			info := d.Info()
			score := 2 * commonPrefix(gp, pciPath(info.PCI))
			if gn >= 0 && gn == info.NUMANode {
				score++
			}
			if score > bestScore {
				best, bestScore = i, score
			}
		}
		m[g.Ordinal] = best
	}
	return m
}

// pciPath is a PCI device's place in the sysfs tree, as path components
// ("pci0000:00", "0000:00:01.0", ...); nil when unknown.
func pciPath(bdf string) []string {
	if bdf == "" {
		return nil
	}
	p, err := filepath.EvalSymlinks(filepath.Join("/sys/bus/pci/devices", normalizeBDF(bdf)))
	if err != nil {
		return nil
	}
	return strings.Split(strings.TrimPrefix(p, "/sys/devices/"), "/")
}

// normalizeBDF turns NVML's "00000000:3B:00.0" into sysfs's "0000:3b:00.0".
func normalizeBDF(bdf string) string {
	bdf = strings.ToLower(bdf)
	if i := strings.IndexByte(bdf, ':'); i > 4 {
		bdf = bdf[i-4:]
	}
	return bdf
}

func pciNUMA(bdf string) int {
	b, err := os.ReadFile(filepath.Join("/sys/bus/pci/devices", normalizeBDF(bdf), "numa_node"))
	if err != nil {
		return -1
	}
	var n int
	if _, err := fmt.Sscan(string(b), &n); err != nil {
		return -1
	}
	return n
}

func commonPrefix(a, b []string) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// cpuNUMA returns the NUMA node of the first CPU the daemon runs on; -1
// when unknown.
func (d *daemon) cpuNUMA() int {
	cpu := 0
	if len(d.cfg.cpus) > 0 {
		cpu = d.cfg.cpus[0]
	}
	m, _ := filepath.Glob(fmt.Sprintf("/sys/devices/system/cpu/cpu%d/node*", cpu))
	for _, p := range m {
		var n int
		if _, err := fmt.Sscanf(filepath.Base(p), "node%d", &n); err == nil {
			return n
		}
	}
	return -1
}

// close releases the path and the device, after the engine and the
// transport server stopped.
func (st *rdmaState) close(log *logrus.Logger) {
	if st == nil {
		return
	}
	if st.path != nil {
		if err := st.path.Close(); err != nil {
			log.WithError(err).Warn("close the RDMA path")
		}
	}
	for _, dev := range st.devs {
		if err := dev.Close(); err != nil {
			log.WithError(err).Warn("close an RDMA device")
		}
	}
}

func (st *rdmaState) statusNow() RDMAStatus {
	if st == nil {
		return RDMAStatus{State: "off", Reason: "one machine: nothing is remote"}
	}
	s := st.status
	if st.path != nil {
		rs := st.path.Stats()
		s.Stats = &rs
	}
	return s
}

// check checks the RDMA flags' values.
func (c *rdmaConfig) check() error {
	if c.mode != "auto" && c.mode != "off" {
		return fmt.Errorf("--rdma %q: want auto or off", c.mode)
	}
	for _, n := range c.devices {
		if n == "" || strings.ContainsAny(n, "/ ") {
			return fmt.Errorf("--rdma-devices: bad device name %q", n)
		}
	}
	if c.fake != "" {
		if fi, err := os.Stat(c.fake); err != nil || !fi.IsDir() {
			return fmt.Errorf("--rdma-fake %s: not a folder", c.fake)
		}
	}
	return nil
}

// gpuMemory is the software NIC's reach into the GPUs (--rdma-fake on a
// GPU host): a dma-buf registration names device memory by the daemon's
// own device address, which, with unified addressing, one context's
// copies reach on every GPU.
type gpuMemory struct{ ctx *cuda.Context }

func (g gpuMemory) Check(fd int, offset, length uint64) error {
	size, err := pinned.DmabufSize(fd)
	if err == nil && (offset > size || length > size-offset) {
		err = fmt.Errorf("%d B at %d of a %d B dma-buf", length, offset, size)
	}
	return err
}

func (g gpuMemory) Read(dst []byte, addr uint64) error {
	return g.ctx.CopyDtoH(dst, cuda.DevicePtr(addr))
}

func (g gpuMemory) Write(addr uint64, src []byte) error {
	return g.ctx.CopyHtoD(cuda.DevicePtr(addr), src)
}
