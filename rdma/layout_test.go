package rdma

import (
	"runtime"
	"strings"
	"testing"
)

// TestLayoutMatchesVerbsHeader compares every size, alignment and offset
// of the structs in mc_verbs.h, every constant it defines, and rdma.go's
// ABI-valued constants with the installed <infiniband/verbs.h>.
func TestLayoutMatchesVerbsHeader(t *testing.T) {
	if !verbsHaveCgo {
		t.Skip("built without cgo: the layout comparison (layout.go) needs cgo")
	}
	rows, haveHeader := mirrorLayout()
	if !haveHeader {
		t.Skip("<infiniband/verbs.h> was not found at build time; install libibverbs-dev to compare mc_verbs.h with it")
	}

	// The rows the binding's correctness rests on must be in the table,
	// so that a table emptied by mistake cannot pass.
	must := []string{
		"sizeof(struct ibv_send_wr)",
		"offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
		"offsetof(struct ibv_send_wr, wr.rdma.rkey)",
		"sizeof(struct ibv_wc)",
		"sizeof(struct ibv_qp_attr)",
		"offsetof(struct ibv_qp_attr, ah_attr.grh.dgid)",
		"offsetof(struct ibv_context, ops.poll_cq)",
		"offsetof(struct ibv_context, ops.post_send)",
		"offsetof(struct ibv_qp, qp_num)",
		"offsetof(struct ibv_mr, lkey)",
		"offsetof(struct ibv_mr, rkey)",
		"offsetof(struct ibv_device, ibdev_path)",
		"offsetof(struct ibv_device_attr, phys_port_cnt)",
		"offsetof(struct ibv_port_attr, link_layer)",
		"sizeof(struct _compat_ibv_port_attr) = sizeof(struct ibv_port_attr) cut after flags",
		"sizeof(struct ibv_context_ops) up to post_send",
		"IBV_WR_RDMA_READ",
		"StatusRemAccessErr = IBV_WC_REM_ACCESS_ERR",
	}
	have := make(map[string]bool, len(rows))
	for _, r := range rows {
		if have[r.what] {
			t.Errorf("row %q appears twice", r.what)
		}
		have[r.what] = true
	}
	for _, w := range must {
		if !have[w] {
			t.Errorf("layout table lacks %q", w)
		}
	}

	var sizes, offsets, aligns, consts int
	for _, r := range rows {
		switch {
		case r.real < 0:
			t.Errorf("%s: no value from verbs.h (%d)", r.what, r.real)
		case r.mirror != r.real:
			t.Errorf("%s: mirror %d, verbs.h %d", r.what, r.mirror, r.real)
		}
		switch {
		case strings.HasPrefix(r.what, "sizeof("):
			sizes++
			t.Logf("%-90s %4d", r.what, r.mirror)
		case strings.HasPrefix(r.what, "offsetof("):
			offsets++
		case strings.HasPrefix(r.what, "alignof("):
			aligns++
		default:
			consts++
		}
	}
	t.Logf("%s/%s: compared %d rows with <infiniband/verbs.h>: %d sizes, %d alignments, %d offsets, %d constants",
		runtime.GOOS, runtime.GOARCH, len(rows), sizes, aligns, offsets, consts)
}
