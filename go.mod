module github.com/mooncake-fs/mooncake-fs

go 1.26.0

require (
	github.com/google/btree v1.1.3 // indirect
	github.com/hanwen/go-fuse/v2 v2.12.1 // indirect
	github.com/prometheus/client_golang v1.25.0 // indirect
	github.com/sirupsen/logrus v1.10.2 // indirect
	golang.org/x/sys v0.50.0 // indirect
)
