/** The sidebar tab's icon: a staircase (Stepwise). Colours follow the theme through `jp-icon3`. */

import { LabIcon } from '@jupyterlab/ui-components';

const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <path class="jp-icon3" fill="#616161" d="M3 20h5v-5h5v-5h5V5h3v2h-1v5h-5v5h-5v5H3z"/>
</svg>`;

export const stepwiseIcon = new LabIcon({ name: 'stepwise-lab:icon', svgstr });
