//go:build cgo

package rdma

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// deviceEnv names the device the hardware test runs on.
const deviceEnv = "MOONCAKE_RDMA_DEVICE"

// sysfsHasDevices reports whether the kernel lists RDMA devices here, as
// an answer independent of libibverbs.
func sysfsHasDevices(t *testing.T) bool {
	t.Helper()
	ents, err := os.ReadDir("/sys/class/infiniband")
	return err == nil && len(ents) > 0
}

// systemHasLibibverbs reports whether libibverbs.so.1 for this
// architecture is in one of the usual library directories, again
// independently of the loader.
func systemHasLibibverbs() bool {
	dirs := []string{"/usr/lib64", "/lib64"}
	if triplet, ok := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[runtime.GOARCH]; ok {
		dirs = append(dirs, "/usr/lib/"+triplet, "/lib/"+triplet)
	}
	for _, dir := range dirs {
		if _, err := os.Stat(filepath.Join(dir, defaultLibibverbs)); err == nil {
			return true
		}
	}
	return false
}

// TestVerbsDevices checks Devices on this machine against what sysfs and
// the library directories say, so that a silently failed load cannot look
// like an empty device list.
func TestVerbsDevices(t *testing.T) {
	p := Verbs()
	if p.Name() != "libibverbs" {
		t.Errorf("Name() = %q, want libibverbs", p.Name())
	}
	devs, err := p.Devices()
	if os.Getenv(libibverbsEnv) == "" && systemHasLibibverbs() && defaultVerbs.err != nil {
		t.Fatalf("libibverbs.so.1 is installed but did not load: %v", defaultVerbs.err)
	}
	if defaultVerbs.err != nil {
		if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), defaultVerbs.path) {
			t.Fatalf("Devices() error = %v; want ErrUnavailable naming %s", err, defaultVerbs.path)
		}
		if devs != nil {
			t.Errorf("Devices() = %v with an error", devs)
		}
		return
	}
	if err != nil {
		t.Fatalf("Devices() error: %v", err)
	}
	if devs == nil {
		t.Errorf("Devices() = nil; want a non-nil list")
	}
	if !sysfsHasDevices(t) && os.Getenv(libibverbsEnv) == "" {
		if len(devs) != 0 {
			t.Fatalf("no devices in sysfs, but Devices() = %+v", devs)
		}
		return
	}
	// With devices (or another library, which sysfs knows nothing of),
	// check what came back for plausibility.
	for _, d := range devs {
		t.Logf("%+v GID %v", d, d.GID)
		if d.Name == "" || d.Port < 1 || (d.LinkLayer != "InfiniBand" && d.LinkLayer != "Ethernet") {
			t.Errorf("implausible device %+v", d)
		}
		if d.PortUp && d.MTU < 256 {
			t.Errorf("%s: active port with MTU %d", d.Name, d.MTU)
		}
	}
}

// TestVerbsMissingLibrary points MOONCAKE_LIBIBVERBS at a file that does
// not exist: every call fails with ErrUnavailable naming the path.
func TestVerbsMissingLibrary(t *testing.T) {
	path := filepath.Join(t.TempDir(), "libibverbs-missing.so.1")
	t.Setenv(libibverbsEnv, path)
	p := &verbsProvider{}
	devs, err := p.Devices()
	if !errors.Is(err, ErrUnavailable) || devs != nil {
		t.Fatalf("Devices() = %v, %v; want nil, ErrUnavailable", devs, err)
	}
	if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), "cannot open shared object file") {
		t.Errorf("Devices() error %q does not carry the dlopen message for %s", err, path)
	}
	if d, err := p.Open("mlx5_0"); !errors.Is(err, ErrUnavailable) || d != nil {
		t.Errorf("Open() = %v, %v; want nil, ErrUnavailable", d, err)
	}
	if r := p.reason(); !strings.HasPrefix(r, path+": cannot open shared object file") {
		t.Errorf("reason() = %q; want the dlopen message", r)
	}
}

// TestVerbsNotALibrary points MOONCAKE_LIBIBVERBS at a text file.
func TestVerbsNotALibrary(t *testing.T) {
	path := filepath.Join(t.TempDir(), "libibverbs.so.1")
	if err := os.WriteFile(path, []byte("not an ELF file, but long enough to have a header's worth of bytes in it\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(libibverbsEnv, path)
	_, err := (&verbsProvider{}).Devices()
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Devices() error = %v; want ErrUnavailable naming %s", err, path)
	}
}

// TestVerbsLibraryWithoutVerbs loads a real library that lacks the verbs
// entry points: the error names the first missing symbol, and the default
// provider is unharmed.
func TestVerbsLibraryWithoutVerbs(t *testing.T) {
	t.Setenv(libibverbsEnv, "libc.so.6")
	_, err := (&verbsProvider{}).Devices()
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "libc.so.6: missing symbol ibv_get_device_list") {
		t.Fatalf("Devices() error = %v; want ErrUnavailable for the missing ibv_get_device_list", err)
	}
	t.Setenv(libibverbsEnv, "")
	if _, err := Verbs().Devices(); systemHasLibibverbs() && err != nil {
		t.Errorf("default provider after a failed load: %v", err)
	}
}

// TestReason checks that Reason explains why RDMA is unusable here, or
// is empty on a machine with an active port.
func TestReason(t *testing.T) {
	r := Reason()
	t.Logf("Reason() = %q", r)
	if strings.Contains(r, "\n") {
		t.Errorf("Reason() spans lines: %q", r)
	}
	switch {
	case defaultVerbs.err != nil:
		if r == "" || !strings.Contains(r, defaultVerbs.path) {
			t.Errorf("library failed to load (%v) but Reason() = %q", defaultVerbs.err, r)
		}
	case !sysfsHasDevices(t) && os.Getenv(libibverbsEnv) == "":
		if !strings.HasPrefix(r, "no RDMA devices") {
			t.Errorf("no devices in sysfs, but Reason() = %q", r)
		}
	default:
		devs, err := Verbs().Devices()
		if err != nil {
			t.Fatal(err)
		}
		up := false
		for _, d := range devs {
			up = up || d.PortUp
		}
		if up != (r == "") {
			t.Errorf("Reason() = %q with devices %+v", r, devs)
		}
	}
}

// TestOpenNonexistent opens a device that does not exist.
func TestOpenNonexistent(t *testing.T) {
	d, err := Verbs().Open("nonexistent-mc0")
	if err == nil || d != nil {
		t.Fatalf("Open(nonexistent-mc0) = %v, %v; want an error", d, err)
	}
	if !errors.Is(err, ErrUnavailable) {
		t.Errorf("Open error %v does not wrap ErrUnavailable", err)
	}
	if defaultVerbs.err == nil && !strings.Contains(err.Error(), `"nonexistent-mc0"`) {
		t.Errorf("Open error %q does not name the device", err)
	}
}

// TestVerbsErrorText checks how a failed call reads and unwraps.
func TestVerbsErrorText(t *testing.T) {
	err := callErr("ibv_reg_mr", 12)
	if got, want := err.Error(), "ibv_reg_mr: cannot allocate memory (errno 12)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if !errors.Is(err, syscall.ENOMEM) {
		t.Errorf("%v does not unwrap to ENOMEM", err)
	}
	if !unsupported(syscall.EOPNOTSUPP) || unsupported(syscall.ENOMEM) {
		t.Errorf("unsupported() misclassifies errnos")
	}
}

// TestGIDScore checks the order in which RoCE GID entries are preferred.
func TestGIDScore(t *testing.T) {
	linkLocal := GID{0xfe, 0x80, 10: 0x02, 11: 0x11, 15: 0x01}
	mapped := GID{10: 0xff, 11: 0xff, 12: 10, 13: 0, 14: 0, 15: 1}
	if !isIPv4Mapped(mapped) || isIPv4Mapped(linkLocal) || isIPv4Mapped(GID{}) {
		t.Errorf("isIPv4Mapped misclassifies")
	}
	order := []struct {
		g   GID
		typ string
	}{
		{GID{}, "RoCE v2"},
		{linkLocal, "IB/RoCE v1"},
		{mapped, "IB/RoCE v1"},
		{linkLocal, "RoCE v2"},
		{mapped, "RoCE v2\n"},
	}
	for i := 1; i < len(order); i++ {
		a := gidScore(order[i-1].g, order[i-1].typ)
		b := gidScore(order[i].g, order[i].typ)
		if a >= b {
			t.Errorf("gidScore(%v, %q) = %d, not below gidScore(%v, %q) = %d",
				order[i-1].g, order[i-1].typ, a, order[i].g, order[i].typ, b)
		}
	}
	if s := gidScore(mapped, "RoCE v2"); s != maxGIDScore {
		t.Errorf("best entry scores %d, maxGIDScore is %d", s, maxGIDScore)
	}
	if gidScore(linkLocal, "") != 1 {
		t.Errorf("an entry of unknown type should still be usable")
	}
}

// TestSysfs checks the sysfs readers on a made-up device directory.
func TestSysfs(t *testing.T) {
	root := t.TempDir()
	pci := filepath.Join(root, "devices", "pci0000:3a", "0000:3b:00.0")
	dev := filepath.Join(root, "class", "mlx5_0")
	for _, d := range []string{pci, filepath.Join(dev, "ports", "1", "gid_attrs", "types")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(pci, filepath.Join(dev, "device")); err != nil {
		t.Fatal(err)
	}
	write := func(path, s string) {
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(pci, "numa_node"), "1\n")
	write(filepath.Join(dev, "ports", "1", "gid_attrs", "types", "3"), "RoCE v2\n")

	if n := numaNode(dev); n != 1 {
		t.Errorf("numaNode = %d, want 1", n)
	}
	if id := pciBusID(dev); id != "0000:3b:00.0" {
		t.Errorf("pciBusID = %q", id)
	}
	if typ := gidType(dev, 1, 3); typ != "RoCE v2" {
		t.Errorf("gidType = %q", typ)
	}
	if typ := gidType(dev, 1, 4); typ != "" {
		t.Errorf("gidType of a missing entry = %q", typ)
	}
	write(filepath.Join(pci, "numa_node"), "-1\n")
	if n := numaNode(dev); n != -1 {
		t.Errorf("numaNode = %d, want -1", n)
	}
	other := filepath.Join(root, "class", "rxe0")
	if numaNode(other) != -1 || pciBusID(other) != "" {
		t.Errorf("a device without sysfs entries should be unknown")
	}
	for s, want := range map[string]bool{
		"0000:3b:00.0": true, "0000:AF:1f.7": true, "0000:3b:00.8": false,
		"0000:3b:00": false, "0000-3b:00.0": false, "virtual": false, "000g:3b:00.0": false,
	} {
		if isPCIBusID(s) != want {
			t.Errorf("isPCIBusID(%q) = %v", s, !want)
		}
	}
}

// TestMTU checks the conversions between bytes and enum ibv_mtu.
func TestMTU(t *testing.T) {
	for m, b := range map[uint32]int{0: 0, 1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096, 6: 0} {
		if got := mtuBytes(m); got != b {
			t.Errorf("mtuBytes(%d) = %d, want %d", m, got, b)
		}
	}
	for b, m := range map[int]uint32{256: 1, 1000: 2, 1024: 3, 4096: 5, 9000: 5} {
		if got, ok := mtuEnum(b); !ok || got != m {
			t.Errorf("mtuEnum(%d) = %d, %v; want %d", b, got, ok, m)
		}
	}
	if _, ok := mtuEnum(255); ok {
		t.Errorf("mtuEnum(255) succeeded")
	}
	if portStateName(4) != "ACTIVE" || portStateName(1) != "DOWN" || portStateName(9) != "in state 9" {
		t.Errorf("portStateName misnames states")
	}
}

// dummyDevice is a device whose C handles are nil: any call that reached
// libibverbs would crash the test, so it can only test checks made in Go.
func dummyDevice() *verbsDevice {
	return &verbsDevice{desc: devDesc{
		info: DeviceInfo{Name: "dummy0", Port: 1, PortUp: true, LinkLayer: "InfiniBand", MTU: 4096, LID: 7},
		caps: devCaps{maxQPWr: 64, maxCQE: 128, maxSGE: 30, maxMsg: 1 << 20},
	}}
}

// dummyQP is a QP of dummyDevice in the given state.
func dummyQP(st QPState) *verbsQP {
	q := &verbsQP{dev: dummyDevice(), depth: 4, ring: make([]wrSlot, 4), qpn: 0x42}
	q.state.Store(uint32(st))
	return q
}

// TestDeviceArgumentChecks checks what RegMR, RegDmabufMR and CreateQP
// refuse before calling libibverbs.
func TestDeviceArgumentChecks(t *testing.T) {
	d := dummyDevice()
	all := AccessLocalWrite | AccessRemoteRead | AccessRemoteWrite
	if _, err := d.RegMR(nil, all); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Errorf("RegMR(nil) = %v", err)
	}
	if _, err := d.RegMR(make([]byte, 8), Access(8)); err == nil {
		t.Errorf("RegMR with unknown access bits succeeded")
	}
	if _, err := d.RegMR(make([]byte, 8), AccessRemoteWrite); err == nil {
		t.Errorf("RegMR with remote write but no local write succeeded")
	}
	if _, err := d.RegDmabufMR(-1, 0, 4096, 0, all); err == nil {
		t.Errorf("RegDmabufMR(fd -1) succeeded")
	}
	if _, err := d.RegDmabufMR(3, 0, 0, 0, all); err == nil {
		t.Errorf("RegDmabufMR(length 0) succeeded")
	}
	for _, depth := range []int{0, -1, 65} {
		if _, err := d.CreateQP(depth); err == nil {
			t.Errorf("CreateQP(%d) succeeded", depth)
		}
	}
	d.desc.caps.maxSGE = 2
	if _, err := d.CreateQP(8); err == nil || !strings.Contains(err.Error(), "SGE") {
		t.Errorf("CreateQP on a device with 2 SGEs = %v", err)
	}
	if d.mrs != 0 || d.qps != 0 {
		t.Errorf("refused calls left counts mrs=%d qps=%d", d.mrs, d.qps)
	}

	d.qps = 1
	if err := d.Close(); err == nil || d.closed {
		t.Errorf("Close with an open QP = %v", err)
	}
	d.qps = 0
	d.closed = true
	if _, err := d.RegMR(make([]byte, 8), all); !errors.Is(err, ErrClosed) {
		t.Errorf("RegMR after Close = %v", err)
	}
	d.desc.caps.maxSGE = 30
	if _, err := d.CreateQP(8); !errors.Is(err, ErrClosed) {
		t.Errorf("CreateQP after Close = %v", err)
	}
	if err := d.Close(); err != nil {
		t.Errorf("second Close = %v", err)
	}
}

// TestPostChecks checks what Post refuses before calling libibverbs.
func TestPostChecks(t *testing.T) {
	good := WorkRequest{ID: 1, Op: OpWrite, Local: []SGE{{Addr: 0x1000, Len: 64, LKey: 1}}, Remote: 0x2000, RKey: 2}
	if err := dummyQP(QPRTS).Post(nil); err != nil {
		t.Errorf("Post(nil) = %v", err)
	}
	for _, st := range []QPState{QPReset, QPInit, QPRTR, QPError} {
		if err := dummyQP(st).Post([]WorkRequest{good}); err == nil || !strings.Contains(err.Error(), "not RTS") {
			t.Errorf("Post in %v = %v", st, err)
		}
	}
	bad := map[string]WorkRequest{
		"no local SGE":   {ID: 2, Op: OpRead, Remote: 0x2000, RKey: 2},
		"at most 4":      {ID: 3, Op: OpWrite, Local: make([]SGE, MaxSGE+1), RKey: 2},
		"zero length":    {ID: 4, Op: OpWrite, Local: []SGE{{Addr: 0x1000, Len: 64}, {Addr: 0x2000}}},
		"opcode":         {ID: 5, Op: Opcode(9), Local: good.Local},
		"largest":        {ID: 6, Op: OpWrite, Local: []SGE{{Addr: 0x1000, Len: 1 << 20}, {Addr: 0x1000, Len: 1}}},
		"work request 0": {ID: 7, Op: OpWrite},
	}
	for want, w := range bad {
		q := dummyQP(QPRTS)
		err := q.Post([]WorkRequest{w, good})
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Post(%+v) = %v; want an error mentioning %q", w, err, want)
		}
		if q.pending != 0 || q.nextSeq != 0 {
			t.Errorf("refused Post left pending=%d nextSeq=%d", q.pending, q.nextSeq)
		}
	}
	q := dummyQP(QPRTS)
	q.pending = q.depth
	if err := q.Post([]WorkRequest{good}); err == nil || !strings.Contains(err.Error(), "QP full") {
		t.Errorf("Post on a full QP = %v", err)
	}
	if n, err := q.Poll(nil); n != 0 || err != nil {
		t.Errorf("Poll(nil) = %d, %v", n, err)
	}
}

// TestConnectChecks checks what Connect refuses before calling libibverbs.
func TestConnectChecks(t *testing.T) {
	ok := Endpoint{LID: 3, QPN: 0x99, PSN: 0x123456, MTU: 4096}
	cases := map[string]Endpoint{
		"24-bit non-zero": {LID: 3, QPN: 0, MTU: 4096},
		"wider":           {LID: 3, QPN: 0x99, PSN: 1 << 24, MTU: 4096},
		"below 256":       {LID: 3, QPN: 0x99, MTU: 128},
		"neither LID":     {QPN: 0x99, MTU: 4096},
	}
	for want, ep := range cases {
		q := dummyQP(QPReset)
		if err := q.Connect(ep); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Connect(%+v) = %v; want an error mentioning %q", ep, err, want)
		}
		if q.State() != QPReset {
			t.Errorf("refused Connect moved the QP to %v", q.State())
		}
	}
	if err := dummyQP(QPRTS).Connect(ok); err == nil || !strings.Contains(err.Error(), "not RESET") {
		t.Errorf("Connect of a connected QP = %v", err)
	}
	ep := dummyQP(QPReset).Endpoint()
	if ep.QPN != 0x42 || ep.LID != 7 || ep.MTU != 4096 {
		t.Errorf("Endpoint() = %+v", ep)
	}
}

// TestClosedQP checks that a closed QP refuses everything and closes again
// quietly.
func TestClosedQP(t *testing.T) {
	q := dummyQP(QPRTS)
	q.closed = true
	w := WorkRequest{Op: OpWrite, Local: []SGE{{Len: 1}}}
	if err := q.Post([]WorkRequest{w}); !errors.Is(err, ErrClosed) {
		t.Errorf("Post = %v", err)
	}
	if _, err := q.Poll(make([]Completion, 1)); !errors.Is(err, ErrClosed) {
		t.Errorf("Poll = %v", err)
	}
	if err := q.Connect(Endpoint{}); !errors.Is(err, ErrClosed) {
		t.Errorf("Connect = %v", err)
	}
	if err := q.Close(); err != nil {
		t.Errorf("Close = %v", err)
	}
	m := &verbsMR{dev: dummyDevice()}
	if err := m.Close(); err != nil {
		t.Errorf("MR Close = %v", err)
	}
}

// TestVerbsLoopback runs RDMA WRITE and READ between two QPs of one
// device connected to each other. It needs hardware: MOONCAKE_RDMA_DEVICE
// names a device with an active port.
func TestVerbsLoopback(t *testing.T) {
	name := os.Getenv(deviceEnv)
	if name == "" {
		t.Skipf("no RDMA device to test on: set %s to one with an active port (e.g. mlx5_0)", deviceEnv)
	}
	dev, err := Verbs().Open(name)
	if err != nil {
		t.Fatalf("Open(%s): %v", name, err)
	}
	info := dev.Info()
	t.Logf("%+v GID %v", info, info.GID)
	if info.Name != name || !info.PortUp || info.MTU < 256 {
		t.Errorf("Info() = %+v", info)
	}

	// Registered memory must not be Go heap: map it.
	const size = 1 << 20
	mem, err := syscall.Mmap(-1, 0, 2*size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	src, dst := mem[:size], mem[size:]
	for i := range src {
		src[i] = byte(i*7 + i>>8)
	}
	all := AccessLocalWrite | AccessRemoteRead | AccessRemoteWrite
	srcMR, err := dev.RegMR(src, all)
	if err != nil {
		t.Fatal(err)
	}
	dstMR, err := dev.RegMR(dst, all)
	if err != nil {
		t.Fatal(err)
	}
	if srcMR.Len() != size || dstMR.Addr() == srcMR.Addr() {
		t.Errorf("MRs: src %#x+%d, dst %#x+%d", srcMR.Addr(), srcMR.Len(), dstMR.Addr(), dstMR.Len())
	}

	const depth = 16
	qa, err := dev.CreateQP(depth)
	if err != nil {
		t.Fatal(err)
	}
	qb, err := dev.CreateQP(depth)
	if err != nil {
		t.Fatal(err)
	}
	ea, eb := qa.Endpoint(), qb.Endpoint()
	if qa.State() != QPReset || ea.QPN == 0 || ea.QPN == eb.QPN || ea.PSN > 0xffffff {
		t.Fatalf("fresh QPs: %v %+v %+v", qa.State(), ea, eb)
	}
	if err := qa.Connect(eb); err != nil {
		t.Fatal(err)
	}
	if err := qb.Connect(ea); err != nil {
		t.Fatal(err)
	}
	if qa.State() != QPRTS || qb.State() != QPRTS {
		t.Fatalf("states after Connect: %v %v", qa.State(), qb.State())
	}

	wait := func(q QP, n int) []Completion {
		t.Helper()
		var got []Completion
		buf := make([]Completion, 8)
		deadline := time.Now().Add(10 * time.Second)
		for len(got) < n {
			k, err := q.Poll(buf)
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, buf[:k]...)
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d completions after 10s", len(got), n)
			}
		}
		return got
	}

	// WRITE two pieces of src, gathered, to dst+100.
	sges := []SGE{
		{Addr: srcMR.Addr(), Len: 4096, LKey: srcMR.LKey()},
		{Addr: srcMR.Addr() + 8192, Len: 1000, LKey: srcMR.LKey()},
	}
	write := WorkRequest{ID: 11, Op: OpWrite, Local: sges, Remote: dstMR.Addr() + 100, RKey: dstMR.RKey()}
	if err := qa.Post([]WorkRequest{write}); err != nil {
		t.Fatal(err)
	}
	c := wait(qa, 1)[0]
	if c != (Completion{ID: 11, Status: StatusSuccess, Op: OpWrite, Bytes: 5096}) {
		t.Fatalf("WRITE completion %+v", c)
	}
	want := append(append([]byte{}, src[:4096]...), src[8192:9192]...)
	if !bytes.Equal(dst[100:100+5096], want) {
		t.Fatalf("WRITE: destination bytes differ")
	}

	// READ them back from dst into src+65536.
	read := WorkRequest{ID: 12, Op: OpRead, Local: []SGE{{Addr: srcMR.Addr() + 65536, Len: 5096, LKey: srcMR.LKey()}},
		Remote: dstMR.Addr() + 100, RKey: dstMR.RKey()}
	if err := qa.Post([]WorkRequest{read}); err != nil {
		t.Fatal(err)
	}
	c = wait(qa, 1)[0]
	if c != (Completion{ID: 12, Status: StatusSuccess, Op: OpRead, Bytes: 5096}) {
		t.Fatalf("READ completion %+v", c)
	}
	if !bytes.Equal(src[65536:65536+5096], want) {
		t.Fatalf("READ: local bytes differ")
	}

	// One Post of more than the depth queues depth requests and fails the
	// rest; they complete in order.
	many := make([]WorkRequest, depth+1)
	for i := range many {
		off := uint64(i) * 4096
		many[i] = WorkRequest{ID: uint64(100 + i), Op: OpWrite,
			Local:  []SGE{{Addr: srcMR.Addr() + off, Len: 4096, LKey: srcMR.LKey()}},
			Remote: dstMR.Addr() + 65536 + off, RKey: dstMR.RKey()}
	}
	if err := qa.Post(many); err == nil || !strings.Contains(err.Error(), "QP full") {
		t.Fatalf("Post of depth+1 requests = %v", err)
	}
	for i, c := range wait(qa, depth) {
		if c.ID != uint64(100+i) || c.Status != StatusSuccess {
			t.Fatalf("completion %d: %+v", i, c)
		}
	}
	if !bytes.Equal(dst[65536:65536+depth*4096], src[:depth*4096]) {
		t.Fatalf("batched WRITEs: destination bytes differ")
	}

	if err := dev.Close(); err == nil {
		t.Fatalf("device Close with MRs and QPs open succeeded")
	}

	// A wrong rkey fails remotely and moves the QP to the error state.
	badKey := write
	badKey.ID, badKey.RKey = 13, dstMR.RKey()^0x5a5a00
	if err := qa.Post([]WorkRequest{badKey}); err != nil {
		t.Fatal(err)
	}
	c = wait(qa, 1)[0]
	t.Logf("bad rkey: %v", &CompletionError{c})
	if c.ID != 13 || c.Status == StatusSuccess || c.Op != OpWrite {
		t.Fatalf("bad-rkey completion %+v", c)
	}
	if qa.State() != QPError {
		t.Errorf("state after a failed completion: %v", qa.State())
	}
	if err := qa.Post([]WorkRequest{write}); err == nil {
		t.Errorf("Post on a QP in error succeeded")
	}

	for _, cl := range []interface{ Close() error }{qa, qb, srcMR, dstMR, dev} {
		if err := cl.Close(); err != nil {
			t.Fatal(err)
		}
		if err := cl.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}
	if _, err := dev.CreateQP(1); !errors.Is(err, ErrClosed) {
		t.Errorf("CreateQP after Close = %v", err)
	}
}
