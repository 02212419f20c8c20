package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// scaleMetric is one quantity plotted against goroutines.
type scaleMetric struct {
	file, title, ylabel string
	value               func(ScalePoint) float64
}

var scaleMetrics = []scaleMetric{
	{"scaling-throughput.png", "granted requests per second", "granted/s", func(p ScalePoint) float64 { return p.PerSec }},
	{"scaling-server-cpu.png", "server CPU per granted request", "µs", func(p ScalePoint) float64 { return p.CPUPerGranted }},
	{"scaling-client-cpu.png", "client CPU per granted request", "µs", func(p ScalePoint) float64 { return p.ClientCPUPerGranted }},
	{"scaling-calls.png", "Redis calls per granted request", "calls", func(p ScalePoint) float64 { return p.CallsPerGranted }},
	{"scaling-latency-p99.png", "p99 booking latency", "µs", func(p ScalePoint) float64 { return float64(p.P99) / float64(time.Microsecond) }},
}

var strategyColors = map[string]color.Color{
	stratCoalesced:   color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff},
	stratUncoalesced: color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff},
	stratPool:        color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff},
	stratRedisRate:   color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff},
}

// writeScalingPlots draws each metric against goroutines (both axes
// logarithmic), a panel per key count, a line per strategy and process
// count (one process solid, more dashed), into dir, and returns the files.
func writeScalingPlots(dir string, rep *ScalingReport) ([]string, error) {
	plot.DefaultTextHandler = text.Plain{Fonts: font.DefaultCache} // "redis_rate" is not TeX
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var keyCounts, procCounts []int
	for _, p := range rep.Points {
		keyCounts = appendNew(keyCounts, p.Keys)
		procCounts = appendNew(procCounts, p.Procs)
	}
	var files []string
	for _, m := range scaleMetrics {
		row := make([]*plot.Plot, len(keyCounts))
		for i, keys := range keyCounts {
			pl := plot.New()
			pl.Title.Text = fmt.Sprintf("%s, %s", m.title, plural(keys, "key"))
			pl.X.Label.Text = "goroutines"
			pl.Y.Label.Text = m.ylabel
			pl.X.Scale, pl.X.Tick.Marker = plot.LogScale{}, goroutineTicks(rep.Points)
			pl.Y.Scale, pl.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{Prec: -1}
			pl.Legend.Top, pl.Legend.Left = true, true
			pl.Legend.XOffs = vg.Millimeter * 2
			pl.Legend.TextStyle.Font.Size = vg.Points(8)
			pl.Add(plotter.NewGrid())
			// Ranges of their own, padded: a log axis needs them above 0
			// even where every point has the same value.
			xlo, xhi, ylo, yhi := math.Inf(1), 0.0, math.Inf(1), 0.0
			for _, p := range rep.Points {
				if v := m.value(p); p.Keys == keys && v > 0 {
					xlo, xhi = min(xlo, float64(p.Goroutines)), max(xhi, float64(p.Goroutines))
					ylo, yhi = min(ylo, v), max(yhi, v)
				}
			}
			if xhi == 0 { // nothing to draw: an empty panel
				xlo, xhi, ylo, yhi = 1, 1, 1, 1
			}
			pl.X.Min, pl.X.Max = xlo/1.5, xhi*1.5
			pl.Y.Min, pl.Y.Max = ylo/1.5, yhi*8 // room above for the legend
			for _, strat := range scaleStrategies {
				for _, procs := range procCounts {
					var xy plotter.XYs
					for _, p := range rep.Points {
						if p.Keys == keys && p.Procs == procs && p.Strategy == strat && m.value(p) > 0 {
							xy = append(xy, plotter.XY{X: float64(p.Goroutines), Y: m.value(p)})
						}
					}
					if len(xy) == 0 {
						continue
					}
					line, points, err := plotter.NewLinePoints(xy)
					if err != nil {
						return nil, err
					}
					line.Color, points.Color = strategyColors[strat], strategyColors[strat]
					line.Width = vg.Points(1.5)
					if procs > 1 {
						line.Dashes = []vg.Length{vg.Points(5), vg.Points(3)}
					}
					pl.Add(line, points)
					pl.Legend.Add(fmt.Sprintf("%s, %s", strat, processes(procs)), line, points)
				}
			}
			row[i] = pl
		}
		if len(row) == 0 {
			continue
		}
		img := vgimg.New(vg.Points(float64(480*len(row))), vg.Points(420))
		dc := draw.New(img)
		tiles := draw.Tiles{Rows: 1, Cols: len(row), PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2,
			PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
		canvases := plot.Align([][]*plot.Plot{row}, tiles, dc)
		for i, pl := range row {
			pl.Draw(canvases[0][i])
		}
		path := filepath.Join(dir, m.file)
		f, err := os.Create(path)
		if err != nil {
			return nil, err
		}
		if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
			f.Close()
			return nil, err
		}
		if err := f.Close(); err != nil {
			return nil, err
		}
		files = append(files, path)
	}
	return files, nil
}

func appendNew(s []int, v int) []int {
	for _, x := range s {
		if x == v {
			return s
		}
	}
	return append(s, v)
}

// goroutineTicks labels the goroutine counts the run has.
func goroutineTicks(points []ScalePoint) plot.ConstantTicks {
	var gs []int
	for _, p := range points {
		gs = appendNew(gs, p.Goroutines)
	}
	ticks := make(plot.ConstantTicks, len(gs))
	for i, g := range gs {
		ticks[i] = plot.Tick{Value: float64(g), Label: fmt.Sprint(g)}
	}
	return ticks
}

func processes(n int) string {
	if n == 1 {
		return "1 process"
	}
	return fmt.Sprintf("%d processes", n)
}
