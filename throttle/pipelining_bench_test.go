package throttle

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/redistest"
)

// BenchmarkBook1Pipelining is a reference for two designs not built: what
// sending book1.lua's calls for different keys pipelined on one connection
// would save, against one call per connection as the engine sends them,
// and what one call booking eight different keys would (the "multikey"
// mode: a prototype of book1.lua looping over its KEYS, here only). It
// runs the bare script call (no engine) over 10,000 keys, from 4 and 64
// goroutines, through a plain go-redis Client and through go-redis's own
// full-duplex AutoPipeline (experimental in go-redis v9.23) on a server of
// its own, and reports the server's CPU per booking (used_cpu_sys +
// used_cpu_user) beside ns/op (per call; a multikey call books eight).
func BenchmarkBook1Pipelining(b *testing.B) {
	srv := redistest.Start(b)
	ctx := context.Background()
	multi := newScript(clockSrc + multikeyProtoSrc)
	for _, mode := range []string{"client", "autopipeline", "multikey"} {
		for _, g := range []int{4, 64} {
			b.Run(fmt.Sprintf("%s/goroutines=%d", mode, g), func(b *testing.B) {
				o := srv.Options()
				var p processor
				rdb := redis.NewClient(o)
				b.Cleanup(func() { _ = rdb.Close() })
				p = rdb
				if mode == "autopipeline" {
					o.AutoPipelineOptions = &redis.AutoPipelineOptions{FullDuplex: true}
					fd := redis.NewClient(o)
					b.Cleanup(func() { _ = fd.Close() })
					ap, err := fd.AutoPipeline()
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { _ = ap.Close() })
					p = ap
				}
				for _, sc := range []*script{book1Script, multi} {
					if err := rdb.ScriptLoad(ctx, sc.src).Err(); err != nil {
						b.Fatal(err)
					}
				}
				per := 1 // bookings per call
				keys := make([]string, 10_000)
				for i := range keys {
					keys[i] = "pipe:{" + strconv.Itoa(i) + "}"
				}
				// A limit never reached (I 1µs, tau 1s): every call books at
				// once. book1.lua takes n*I, tau+I and the max wait; the
				// prototype I, tau, n and the max wait.
				args := []any{"", 1, 1_000_001, 1_000_000}
				if mode == "multikey" {
					args = []any{"", 1, 1_000_000, 1, 1_000_000}
				}
				var next atomic.Int64
				cpu0 := serverCPU(b, rdb)
				b.SetParallelism(max(1, g/runtime.GOMAXPROCS(0))) // g goroutines
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					k := int(next.Add(1)) * 7919
					for pb.Next() {
						var cmd *redis.Cmd
						if mode == "multikey" {
							ks := make([]any, 0, 3+multikeyProtoKeys+len(args))
							ks = append(ks, "evalsha", multi.hash, multikeyProtoKeys)
							for range multikeyProtoKeys {
								ks = append(ks, keys[k%len(keys)])
								k++
							}
							cmd = redis.NewCmd(ctx, append(ks, args...)...)
						} else {
							key := keys[k%len(keys)]
							k++
							cmd = redis.NewCmd(ctx, append([]any{"evalsha", book1Script.hash, 1, key}, args...)...)
						}
						if err := p.Process(ctx, cmd); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.StopTimer()
				if mode == "multikey" {
					per = multikeyProtoKeys
				}
				b.ReportMetric((serverCPU(b, rdb)-cpu0)*1e6/float64(b.N*per), "server-µs/booking")
			})
		}
	}
}

// serverCPU is the server's used_cpu_sys + used_cpu_user, in seconds.
func serverCPU(b *testing.B, rdb *redis.Client) float64 {
	info, err := rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var sum float64
	for _, line := range strings.Split(info, "\r\n") {
		for _, f := range []string{"used_cpu_sys:", "used_cpu_user:"} {
			if v, ok := strings.CutPrefix(line, f); ok {
				x, err := strconv.ParseFloat(v, 64)
				if err != nil {
					b.Fatal(err)
				}
				sum += x
			}
		}
	}
	return sum
}

// multikeyProtoKeys is how many keys one multikey call books.
const multikeyProtoKeys = 8

// multikeyProtoSrc is book1.lua's decision for each of KEYS in turn, one
// reply triple per key: a prototype for BenchmarkBook1Pipelining only.
const multikeyProtoSrc = `
local interval, tau, n, maxwait = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0, ARGV[5] + 0
local out = {}
for i = 1, #KEYS do
  local tat = stored(KEYS[i], now, interval, tau) or now
  if tat < now then tat = now end
  local wait = tat + (n - 1) * interval - tau - now
  if wait < 0 then wait = 0 end
  if wait > maxwait then
    out[#out + 1], out[#out + 2], out[#out + 3] = now, tat, -1 - wait
  else
    local new = tat + n * interval
    redis.call('SET', KEYS[i], string.format('%d', new), 'PX', px(new, now, hold))
    out[#out + 1], out[#out + 2], out[#out + 3] = now, tat, wait
  end
end
return out
`
