# mooncake-fs: `make run` mounts /mnt/mooncake in the foreground, `make test` tests.
GO        ?= go
BIN       := bin/mooncake-fs
MOUNT     ?= /mnt/mooncake
MOUNTARGS ?=
UNIT_PKGS := $$($(GO) list ./... | grep -v /tests)
# go-nvml's header marks parts of NVML deprecated; cgo would print a page
# of warnings about declarations we never call.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

.PHONY: build run test unit e2e bench fuzz vet clean

build:
	$(GO) build -o $(BIN) ./cmd/mooncake-fs

run: build
	$(BIN) mount $(MOUNTARGS) $(MOUNT)

vet:
	$(GO) vet ./...
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }

# Unit tests with expensive invariant checks and the race detector, then the
# end-to-end tests against real mounts.
test: vet unit e2e

unit:
	$(GO) test -tags invariants -race -count=1 $(UNIT_PKGS)

e2e:
	$(GO) test -count=1 -timeout 9m ./tests/

bench: build
	$(BIN) bench --json

# Short fuzzing runs of every decoder of untrusted bytes.
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzDecode -fuzztime 30s ./ioctl/
	$(GO) test -run '^$$' -fuzz FuzzIoctl -fuzztime 60s ./fs/

clean:
	rm -rf bin
